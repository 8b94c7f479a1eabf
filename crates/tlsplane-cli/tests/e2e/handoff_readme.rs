//! The README's Python hand-off receiver, run as written (only its socket path is this
//! test's): it must serve a client that sends no server name as well as one that does.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::handoff::{have_python, scratch, wait_receivers};
use crate::support::client::Tls;
use crate::support::{tools, Server};

/// The receiver program in the README's hand-off section, connecting to `socket`.
fn readme_receiver(socket: &Path) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme
        .find("cat > /tmp/receiver.py <<'PY'\n")
        .expect("the README's Python receiver");
    let body = &readme[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let program = &body[..body.find("\nPY\n").expect("the end of the receiver")];
    let connect = "tlsplane_handoff.connect(";
    let at = program.find(connect).expect("its connect call") + connect.len();
    let end = at + program[at..].find(')').unwrap();
    format!(
        "{}{:?}{}",
        &program[..at],
        socket.display().to_string(),
        &program[end..]
    )
}

/// Killed when dropped, also when an assertion fails first.
struct Receiver(Child);

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_readme_python_receiver_serves_clients_with_and_without_sni() {
    if !have_python() || !tools::require("curl") {
        return;
    }
    let dir = scratch("handoff-readme-python");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    let err_path = dir.join("receiver.err");
    let _rx = Receiver(
        Command::new("python3")
            .arg("-c")
            .arg(readme_receiver(&socket))
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .spawn()
            .expect("python3"),
    );
    wait_receivers(&server, 1);
    let port = server.port();
    // An address in the URL: curl sends no SNI. Then a name: it does.
    for (url, hello) in [
        (format!("https://127.0.0.1:{port}/"), "hello you,"),
        (format!("https://localhost:{port}/"), "hello localhost,"),
    ] {
        let out = Tls::V13.curl(port, 20).arg(&url).output().expect("curl");
        let body = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && body.starts_with(hello),
            "{url}: {body:?}\ncurl: {}\nreceiver: {}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
    }
    let stats = server.stop();
    assert_eq!(crate::handoff::handed_off(&stats), 2, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}
