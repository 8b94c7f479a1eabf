//! HTTP mode, an HTTP/1.1 client on a site whose backends speak h2c: each request becomes a
//! stream on an h2c backend connection (as nginx's `grpc_pass` and HAProxy's `proto h2`
//! servers serve HTTP/1.1 clients).
//!
//! The request's head is the one an HTTP/1.1 backend would get ([`RequestHead::encode`]: the
//! same hop-by-hop and `Forwarded`/`X-Forwarded-*` rules), written as h2 fields as for h2
//! clients ([`super::h2::open_h2c_stream`]); `TE: trailers` is passed on when the client sent
//! it. An HTTP/1.0 request without `Host` (HTTP/1.0 allows it; HTTP/1.1 does not, RFC 9112
//! §3.2: 400 before this) has the TLS server name the client sent as its `:authority`, else
//! the backend's `HOST:PORT` (nginx's `$proxy_host`), as h2 requires one. The body (by
//! `Content-Length`, or dechunked) goes as DATA within the stream's window. The trailer
//! section of a chunked request goes as an h2 trailers HEADERS frame that ends the stream
//! (RFC 9113 §8.1): its length is bounded by the chunked parser (`BodyFraming`, which also
//! refuses with 400 any field a trailer may not carry, RFC 9110 §6.5.1), its field count by a
//! request head's (64); past either, 400 to the client and the backend's stream reset. A body
//! coded otherwise than `chunked` alone (`gzip, chunked`) has no h2 form: 501.
//!
//! Interim responses of the backend (103 Early Hints, 102, 1xx not yet defined) are relayed
//! as HTTP/1.1 heads before the final one (RFC 9110 §15.2), also while the request body is
//! still coming (h2's `ResponseFuture::poll_informational`), at most [`MAX_INTERIM`] a
//! request, later ones dropped: they are advisory, and the final response still comes. None
//! to an HTTP/1.0 client, none of 100 (the proxy answers `Expect` itself) nor of 101.
//!
//! The response head is written as an HTTP/1.1 head and read back by
//! [`forward::parse_response_head`], so that its framing (HEAD, 204, 304: no body) and its
//! connection fields are the HTTP/1.1 path's: `Content-Length` when the backend gave one and
//! no trailers are to follow (the client takes trailers, `TE: trailers`, and the response
//! announces them in `Trailer`), else chunked; an HTTP/1.0 client, which cannot read chunked,
//! gets the body to the connection's close. h2 trailers become the chunked trailer section
//! when the client said `TE: trailers` (RFC 9110 §6.5.1: a sender may drop trailers, and one
//! that does not know the client takes them does), and are dropped otherwise.
//!
//! Failures are the HTTP/1.1 path's: 502/503 when no backend takes the request, 502 when the
//! backend resets the stream or goes away before the response head, 504 past
//! --backend-timeout; once the head is out, a reset of the client's connection (never a short
//! body that looks whole).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};
use tlsplane::TlsStream;
use tlsplane_http::forward::{self, BodyFraming, Framing, Head, RequestHead, ResponseHead};
use tokio::time::timeout;

use super::h2::{
    encoded_fields, is_connection_specific, open_h2c_stream, request_deadline, send_granted,
    within, Dechunk, H2cStream, NoAuthority, NotOpened, Step, TooManyTrailers,
};
use super::http::{
    answer, failed, unavailable, Buf, Fail, Log, Next, Progress, MAX_RESPONSE_FIELDS,
    MAX_RESPONSE_HEAD,
};
use super::{Ended, Proxy, Responses};

/// Forwards one HTTP/1.1 request (its head as encoded for an HTTP/1.1 backend, `encoded`;
/// `Expect` already answered) to an h2c backend, and relays the response.
#[allow(clippy::too_many_arguments)]
pub(super) async fn exchange(
    proxy: &Proxy,
    tls: &mut TlsStream,
    peer: SocketAddr,
    request: &RequestHead,
    encoded: &[u8],
    client: &mut Buf,
    keep_alive: bool,
    log: &Log<'_>,
    responses: &Responses<'_>,
) -> Next {
    let has_body = request.framing != Framing::Empty;
    if !h2_can_carry(encoded) {
        // The body is not read: close after.
        proxy.stats.http_refused.fetch_add(1, Relaxed);
        let _ = answer(tls, responses, 501, false).await;
        log(tls, 501, "-", None);
        return Next::End(Ended::ClientError);
    }
    let site = tls.info().site;
    let deadline = request_deadline(proxy);
    // Only an HTTP/1.0 request comes without Host (HTTP/1.1 ones were refused).
    let no_authority = if request.minor_version == 0 {
        NoAuthority::ServerName(tls.info().server_name.as_deref())
    } else {
        NoAuthority::Refused
    };
    let opened = open_h2c_stream(
        proxy,
        site,
        encoded,
        request,
        request.te_trailers,
        !has_body,
        no_authority,
    );
    let H2cStream {
        lease,
        label,
        response,
        upstream,
    } = match opened.await {
        Ok(s) => s,
        Err(NotOpened::Refused) => {
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            let _ = answer(tls, responses, 400, false).await;
            log(tls, 400, "-", None);
            return Next::End(Ended::ClientError);
        }
        Err(NotOpened::Unavailable(why)) => {
            return unavailable(proxy, tls, responses, why, keep_alive && !has_body, log).await
        }
        Err(NotOpened::Failed(fail, label)) => {
            if matches!(fail, Fail::Timeout) {
                log(tls, 504, &label, None);
            }
            return failed(proxy, tls, responses, peer, fail, log).await;
        }
    };
    let progress = Step::new(Progress::Waiting);
    let relayed = relay(
        proxy, tls, request, client, upstream, response, keep_alive, &progress, responses,
    );
    let outcome = within(deadline, &progress, relayed).await;
    // The stream is over either way (a stream not ended is reset as its handles go).
    drop(lease);
    match outcome {
        Ok(done) => {
            log(tls, done.status, &label, Some(done.bytes));
            if done.keep {
                return Next::KeepAlive;
            }
            // Lingering: the rest of a body answered early, or pipelined requests, may still
            // be coming.
            let _ = Box::pin(tls.close()).await;
            Next::End(Ended::Closed)
        }
        Err(fail) => {
            match &fail {
                Fail::Timeout | Fail::Deadline(Progress::Waiting) => log(tls, 504, &label, None),
                Fail::Deadline(Progress::Receiving) => log(tls, 408, &label, None),
                _ => {}
            }
            let fail = match fail {
                Fail::BadGateway(why) => Fail::BadGateway(format!("{label}: {why}")),
                Fail::Midway(why) => Fail::Midway(format!("{label}: {why}")),
                other => other,
            };
            failed(proxy, tls, responses, peer, fail, log).await
        }
    }
}

/// A response relayed whole.
struct Done {
    status: u16,
    /// Body bytes relayed.
    bytes: u64,
    /// The client's connection goes on.
    keep: bool,
}

/// Sends the request body (and its trailers) and relays the response; watches for the
/// response while the body is still coming (a backend may answer before it has it all: the
/// body then stops, and the client's connection closes after the response, as on the
/// HTTP/1.1 path). Interim responses that come first are relayed as they come ([`Interim`]).
#[allow(clippy::too_many_arguments)]
async fn relay(
    proxy: &Proxy,
    tls: &mut TlsStream,
    request: &RequestHead,
    client: &mut Buf,
    mut upstream: SendStream<Bytes>,
    mut response: h2::client::ResponseFuture,
    keep_alive: bool,
    progress: &Step,
    responses: &Responses<'_>,
) -> Result<Done, Fail> {
    let stats = &proxy.stats;
    let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
    let idle = Duration::from_secs(proxy.args.server.idle_timeout);
    let stall = Duration::from_secs(proxy.args.backend_timeout.max(1));
    let mut interim = Interim::new(request, responses);
    let mut answered = None;
    let mut body_sent = request.framing == Framing::Empty;
    if !body_sent {
        let mut framing = BodyFraming::new(request.framing);
        let mut dechunk = Dechunk::new(request.framing == Framing::Chunked).keeping_trailers();
        let mut content = Vec::new();
        // A broken body: the backend's stream is reset (it must not take what it got for a
        // whole request), the client answered 400.
        let bad_body = |upstream: &mut SendStream<Bytes>| {
            upstream.send_reset(Reason::CANCEL);
            Fail::BadBody
        };
        'body: loop {
            // What the client sent (with the head, or since) and the backend has not had.
            let n = match framing.advance(client.bytes()) {
                Ok(n) => n,
                Err(_) => return Err(bad_body(&mut upstream)),
            };
            dechunk.content(&client.bytes()[..n], &mut content);
            client.consume(n);
            if !content.is_empty() {
                progress.set(Progress::Waiting);
                let len = content.len() as u64;
                let data = Bytes::from(std::mem::take(&mut content));
                // Not cancelled by an interim response: what it has not sent yet would be lost.
                let sending = send_granted(&mut upstream, data, stall, None);
                tokio::pin!(sending);
                loop {
                    tokio::select! {
                        sent = &mut sending => {
                            if sent.is_err() {
                                // The backend stopped taking the body: its response says why.
                                break 'body;
                            }
                            stats.bytes_to_backend_copied.fetch_add(len, Relaxed);
                            break;
                        }
                        a = next_answer(&mut response) => match a {
                            Answer::Interim(head) => interim.relay(proxy, tls, &head).await?,
                            Answer::Final(r) => {
                                answered = Some(r);
                                break 'body;
                            }
                        }
                    }
                }
            }
            if framing.is_done() {
                body_sent = match dechunk.trailers() {
                    Err(TooManyTrailers) => return Err(bad_body(&mut upstream)),
                    Ok(t) if t.is_empty() => upstream.send_data(Bytes::new(), true).is_ok(),
                    // RFC 9113 §8.1: a HEADERS frame that ends the stream.
                    Ok(t) => upstream.send_trailers(t).is_ok(),
                };
                break;
            }
            progress.set(Progress::Receiving);
            client.grow_to_limit();
            tokio::select! {
                r = timeout(idle, tls.read(client.spare())) => match r {
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(Fail::Client),
                    Ok(Ok(n)) => client.filled(n),
                },
                a = next_answer(&mut response) => match a {
                    Answer::Interim(head) => interim.relay(proxy, tls, &head).await?,
                    Answer::Final(r) => {
                        answered = Some(r);
                        break;
                    }
                }
            }
        }
    }
    progress.set(Progress::Waiting);
    let response = match answered {
        Some(r) => r,
        None => {
            // The whole wait is bounded, however many interim responses come in it.
            let until = tokio::time::Instant::now() + backend_timeout;
            loop {
                match tokio::time::timeout_at(until, next_answer(&mut response)).await {
                    Err(_) => return Err(Fail::Timeout),
                    Ok(Answer::Interim(head)) => interim.relay(proxy, tls, &head).await?,
                    Ok(Answer::Final(r)) => break r,
                }
            }
        }
    }
    .map_err(|e| Fail::BadGateway(e.to_string()))?;
    let answered_early = !body_sent;
    if answered_early {
        stats.early_responses.fetch_add(1, Relaxed);
    }
    let (parts, mut from) = response.into_parts();
    if parts.status.is_informational() {
        // h2 passes on no interim response as the final one, and 101 has no place in h2.
        return Err(Fail::BadGateway(format!("final status {}", parts.status)));
    }
    let head = http1_response_head(&parts, from.is_end_stream(), request);
    let response = match forward::parse_response_head(
        &head,
        request,
        MAX_RESPONSE_HEAD,
        MAX_RESPONSE_FIELDS,
    ) {
        Ok(Head::Complete(r, _)) => r,
        Ok(Head::Incomplete) => return Err(Fail::BadGateway("response head too large".into())),
        Err(e) => return Err(Fail::BadGateway(e.to_string())),
    };
    let keep = keep_alive && !answered_early && response.framing != Framing::UntilClose;
    let mut out = Vec::with_capacity(512);
    response.encode(request.minor_version, keep, &mut out);
    progress.set(Progress::Responding);
    responses.begin(response.status);
    tls.write_all(&out).await.map_err(|_| Fail::Client)?;
    stats
        .bytes_to_client_copied
        .fetch_add(out.len() as u64, Relaxed);
    let bytes = relay_body(
        proxy,
        tls,
        &response,
        &mut from,
        request.te_trailers && request.minor_version == 1,
    )
    .await?;
    Ok(Done {
        status: response.status,
        bytes,
        keep,
    })
}

/// What came next on a request's stream: an interim (1xx) response head, or the final
/// response.
pub(super) enum Answer {
    Interim(http::Response<()>),
    Final(Result<http::Response<RecvStream>, h2::Error>),
}

/// Waits for the next [`Answer`]. Interim heads are taken first: h2 drops any still queued
/// when the final response is taken. Cancel-safe (a head is taken only when returned).
pub(super) async fn next_answer(response: &mut h2::client::ResponseFuture) -> Answer {
    std::future::poll_fn(|cx| match response.poll_informational(cx) {
        Poll::Ready(Some(Ok(head))) => Poll::Ready(Answer::Interim(head)),
        Poll::Ready(Some(Err(e))) => Poll::Ready(Answer::Final(Err(e))),
        // The final response is next (or the stream ended without one: its error).
        Poll::Ready(None) => Pin::new(&mut *response).poll(cx).map(Answer::Final),
        Poll::Pending => Poll::Pending,
    })
    .await
}

/// Most interim responses relayed to one request; later ones are dropped. 1xx responses
/// are advisory (RFC 9110 §15.2), so a backend that sends many (102 as a keep-alive, 103
/// again and again) loses the extra ones, not the exchange: its final response still comes.
const MAX_INTERIM: usize = 4;

/// Which of a request's interim responses go to the client: the rule for every pair of
/// protocols that relays them (an h2c or HTTP/1.1 backend's, to an h2 or HTTP/1.1 client).
/// Never a 100, whose expectation the proxy answered itself (`Expect` is not forwarded), nor
/// a 101, which only a tunnel the client asked for may take; at most [`MAX_INTERIM`].
#[derive(Default)]
pub(super) struct InterimBudget {
    relayed: usize,
}

impl InterimBudget {
    /// Whether an interim response with `status` goes to the client (counted if so).
    pub(super) fn admits(&mut self, status: u16) -> bool {
        if !(102..200).contains(&status) || self.relayed >= MAX_INTERIM {
            return false;
        }
        self.relayed += 1;
        true
    }
}

/// Relays a backend's interim responses to the client (RFC 9110 §15.2: a proxy forwards
/// them), as HTTP/1.1 heads: 103 Early Hints, 102, and those not yet defined. Never to an
/// HTTP/1.0 client, which does not expect them; never a 100, whose expectation the proxy
/// answered itself (`Expect` is not forwarded), nor a 101, which h2 has no use for.
struct Interim<'a> {
    /// The client reads them (HTTP/1.1).
    wanted: bool,
    budget: InterimBudget,
    responses: &'a Responses<'a>,
}

impl<'a> Interim<'a> {
    fn new(request: &RequestHead, responses: &'a Responses<'a>) -> Self {
        Self {
            wanted: request.minor_version == 1,
            budget: InterimBudget::default(),
            responses,
        }
    }

    async fn relay(
        &mut self,
        proxy: &Proxy,
        tls: &mut TlsStream,
        head: &http::Response<()>,
    ) -> Result<(), Fail> {
        if !self.wanted || !self.budget.admits(head.status().as_u16()) {
            return Ok(());
        }
        self.responses.begin(head.status().as_u16());
        let out = interim_head(head);
        tls.write_all(&out).await.map_err(|_| Fail::Client)?;
        proxy
            .stats
            .bytes_to_client_copied
            .fetch_add(out.len() as u64, Relaxed);
        Ok(())
    }
}

/// An h2 interim response as an HTTP/1.1 head (its fields as they came, less any h2 forbids,
/// which h2 has refused already).
fn interim_head(head: &http::Response<()>) -> Vec<u8> {
    let status = head.status();
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or_default().as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in head.headers() {
        if is_connection_specific(name.as_str().as_bytes()) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Relays the response body from the backend's stream in `response`'s framing; how many
/// bytes of content. A body that does not match its `Content-Length`, or that the backend
/// breaks off, fails midway (the client is reset).
async fn relay_body(
    proxy: &Proxy,
    tls: &mut TlsStream,
    response: &ResponseHead,
    from: &mut RecvStream,
    trailers_wanted: bool,
) -> Result<u64, Fail> {
    let stats = &proxy.stats;
    let wait = Duration::from_secs(proxy.args.backend_timeout);
    if response.framing == Framing::Empty {
        // HEAD, 204, 304: whatever the backend sends is not relayed (the stream is reset as
        // it goes).
        return Ok(0);
    }
    let chunked = response.framing == Framing::Chunked;
    let mut sent = 0u64;
    let mut out = Vec::new();
    loop {
        let data = match timeout(wait, from.data()).await {
            Err(_) => return Err(Fail::Midway("timed out in the middle of the body".into())),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Fail::Midway(e.to_string())),
            Ok(Some(Ok(d))) => d,
        };
        let n = data.len();
        if n == 0 {
            continue;
        }
        if let Framing::Length(want) = response.framing {
            if sent + n as u64 > want {
                return Err(Fail::Midway("more body than its Content-Length".into()));
            }
        }
        out.clear();
        if chunked {
            out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
            out.extend_from_slice(&data);
            out.extend_from_slice(b"\r\n");
            tls.write_all(&out).await.map_err(|_| Fail::Client)?;
        } else {
            tls.write_all(&data).await.map_err(|_| Fail::Client)?;
        }
        // The backend may send more only as the client takes it.
        let _ = from.flow_control().release_capacity(n);
        stats.bytes_to_client_copied.fetch_add(n as u64, Relaxed);
        sent += n as u64;
    }
    let trailers = match timeout(wait, from.trailers()).await {
        Err(_) => return Err(Fail::Midway("timed out before the trailers".into())),
        Ok(Err(e)) => return Err(Fail::Midway(e.to_string())),
        Ok(Ok(t)) => t,
    };
    match response.framing {
        Framing::Length(want) if sent != want => {
            return Err(Fail::Midway("less body than its Content-Length".into()))
        }
        Framing::Chunked => {
            out.clear();
            last_chunk(trailers.as_ref().filter(|_| trailers_wanted), &mut out);
            tls.write_all(&out).await.map_err(|_| Fail::Client)?;
        }
        _ => {}
    }
    Ok(sent)
}

/// Whether h2 can carry a request body framed as in `encoded` (the HTTP/1.1 head the proxy
/// wrote): h2 has no transfer codings, so a body coded otherwise than `chunked` alone
/// (`gzip, chunked`) cannot go as it is.
fn h2_can_carry(encoded: &[u8]) -> bool {
    encoded_fields(encoded)
        .filter(|(name, _)| name.eq_ignore_ascii_case(b"transfer-encoding"))
        .all(|(_, value)| value.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// An h2 response head as an HTTP/1.1 one, for [`forward::parse_response_head`] to read as it
/// reads an HTTP/1.1 backend's. Its framing fields: the backend's `Content-Length` when it
/// gave one, unless trailers are to follow that the client takes (`TE: trailers`, and a
/// `Trailer` field announcing them); `Content-Length: 0` for a response that ended with its
/// head; else `Transfer-Encoding: chunked` (none to an HTTP/1.0 client: its body goes to the
/// connection's close). None of them for a response without a body (HEAD, 204, 304).
fn http1_response_head(
    parts: &http::response::Parts,
    end_stream: bool,
    request: &RequestHead,
) -> Vec<u8> {
    let fields = &parts.headers;
    let http11 = request.minor_version == 1;
    let trailers_follow =
        !end_stream && http11 && request.te_trailers && fields.contains_key(http::header::TRAILER);
    let length = fields.contains_key(http::header::CONTENT_LENGTH) && !trailers_follow;
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or_default()
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    let mut field = |name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in fields {
        let name = name.as_str().as_bytes();
        // h2 has refused connection-specific fields already; none is let through here.
        if is_connection_specific(name) || (name.eq_ignore_ascii_case(b"content-length") && !length)
        {
            continue;
        }
        field(name, value.as_bytes());
    }
    // A HEAD, 204 or 304 response has no body whatever its fields say, and the length of
    // one to HEAD or 304 is the representation's: not to be made up.
    let bodiless = request.is_head() || matches!(parts.status.as_u16(), 204 | 304);
    if !length && !bodiless {
        if end_stream {
            field(b"Content-Length", b"0");
        } else if http11 {
            field(b"Transfer-Encoding", b"chunked");
        }
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// The end of a chunked body: the last chunk and the trailer section (`trailers`, without
/// the fields a trailer may not carry, [`forward::may_be_trailer`]: RFC 9110 §6.5.1's list and
/// the forwarding fields; a recipient that merges trailers into the head would take them for
/// fields the proxy wrote or checked). Both ways: an h2c backend's trailers to an HTTP/1.1
/// client, an h2 client's to an HTTP/1.1 backend.
pub(super) fn last_chunk(trailers: Option<&http::HeaderMap>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n");
    for (name, value) in trailers.into_iter().flatten() {
        let name = name.as_str().as_bytes();
        if !forward::may_be_trailer(name) {
            continue;
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// `trailers` without the fields a trailer may not carry ([`forward::may_be_trailer`], as
/// [`last_chunk`] leaves them out), for h2 trailers relayed as h2 trailers (h2 client to h2c
/// backend and back); `None` when none is left.
pub(super) fn relayable_trailers(mut trailers: http::HeaderMap) -> Option<http::HeaderMap> {
    let forbidden: Vec<http::HeaderName> = trailers
        .keys()
        .filter(|name| !forward::may_be_trailer(name.as_str().as_bytes()))
        .cloned()
        .collect();
    for name in forbidden {
        trailers.remove(&name);
    }
    (!trailers.is_empty()).then_some(trailers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tlsplane_http::forward::{ForwardedPolicy, Origin};
    use tlsplane_http::Limits;

    fn request(raw: &str) -> RequestHead {
        match forward::parse_request_head(
            raw.as_bytes(),
            &Limits::default(),
            ForwardedPolicy::Replace,
        ) {
            Ok(Head::Complete(r, _)) => r,
            other => panic!("{raw:?}: {other:?}"),
        }
    }

    fn encoded(r: &RequestHead) -> Vec<u8> {
        let mut out = Vec::new();
        r.encode(
            Origin {
                client: "192.0.2.7".parse().unwrap(),
                proto: "https",
            },
            ForwardedPolicy::Replace,
            &mut out,
        );
        out
    }

    /// The HTTP/1.1 head the client gets for an h2 response to `req`.
    fn client_head(
        req: &RequestHead,
        status: u16,
        fields: &[(&str, &str)],
        end_stream: bool,
        keep: bool,
    ) -> (String, Framing) {
        let mut b = http::Response::builder().status(status);
        for (n, v) in fields {
            b = b.header(*n, *v);
        }
        let (parts, ()) = b.body(()).unwrap().into_parts();
        let head = http1_response_head(&parts, end_stream, req);
        let Ok(Head::Complete(r, _)) =
            forward::parse_response_head(&head, req, MAX_RESPONSE_HEAD, MAX_RESPONSE_FIELDS)
        else {
            panic!("{}", String::from_utf8_lossy(&head));
        };
        let mut out = Vec::new();
        r.encode(req.minor_version, keep, &mut out);
        (String::from_utf8(out).unwrap(), r.framing)
    }

    #[test]
    fn an_http1_request_becomes_an_h2_request_with_the_forwarding_rules() {
        let r = request(
            "POST /svc/M?x=1 HTTP/1.1\r\nHost: grpc.test:8443\r\nConnection: keep-alive, X-Hop\r\n\
             X-Hop: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\nTransfer-Encoding: chunked\r\n\
             X-Forwarded-For: 6.6.6.6\r\nUpgrade: h2c\r\nContent-Type: application/grpc\r\n\r\n",
        );
        let head = encoded(&r);
        assert!(h2_can_carry(&head));
        let req = super::super::h2::h2c_request(&head, &r, r.te_trailers, None).unwrap();
        assert_eq!(req.method(), "POST");
        assert_eq!(req.uri().authority().unwrap().as_str(), "grpc.test:8443");
        assert_eq!(req.uri().path_and_query().unwrap().as_str(), "/svc/M?x=1");
        let f = req.headers();
        for gone in [
            "host",
            "connection",
            "x-hop",
            "keep-alive",
            "transfer-encoding",
            "upgrade",
            "content-length",
        ] {
            assert!(!f.contains_key(gone), "{gone}: {f:?}");
        }
        assert_eq!(f["te"], "trailers");
        assert_eq!(f["x-forwarded-for"], "192.0.2.7");
        assert_eq!(f["x-forwarded-proto"], "https");
        assert_eq!(f["content-type"], "application/grpc");
        assert!(f["forwarded"]
            .to_str()
            .unwrap()
            .starts_with("for=192.0.2.7;proto=https"));

        // No TE: trailers, none sent; a Content-Length stays.
        let r = request("PUT /p HTTP/1.1\r\nHost: a\r\nTE: gzip\r\nContent-Length: 5\r\n\r\n");
        let req = super::super::h2::h2c_request(&encoded(&r), &r, r.te_trailers, None).unwrap();
        assert!(!req.headers().contains_key("te"));
        assert_eq!(req.headers()["content-length"], "5");
    }

    #[test]
    fn an_http10_request_without_host_takes_the_authority_given() {
        let r = request("GET /p HTTP/1.0\r\n\r\n");
        assert!(super::super::h2::h2c_request(&encoded(&r), &r, false, None).is_none());
        let req = super::super::h2::h2c_request(&encoded(&r), &r, false, Some("site.test"))
            .expect("a request");
        assert_eq!(req.uri().authority().unwrap().as_str(), "site.test");
        assert_eq!(req.uri().path_and_query().unwrap().as_str(), "/p");
        // The request's own wins.
        let r = request("GET /p HTTP/1.0\r\nHost: own.test\r\n\r\n");
        let req = super::super::h2::h2c_request(&encoded(&r), &r, false, Some("site.test"))
            .expect("a request");
        assert_eq!(req.uri().authority().unwrap().as_str(), "own.test");
    }

    #[test]
    fn at_most_four_interim_responses_are_relayed_never_100_nor_101() {
        let mut budget = InterimBudget::default();
        for status in [100, 101, 200, 99] {
            assert!(!budget.admits(status), "{status}");
        }
        let admitted: Vec<bool> = [103, 102, 199, 103, 103, 102]
            .iter()
            .map(|&s| budget.admits(s))
            .collect();
        assert_eq!(admitted, [true, true, true, true, false, false]);
    }

    #[test]
    fn interim_heads_are_written_as_http1_heads() {
        let head = http::Response::builder()
            .status(103)
            .header("link", "</s.css>; rel=preload")
            .body(())
            .unwrap();
        assert_eq!(
            interim_head(&head),
            b"HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\n\r\n"
        );
        let head = http::Response::builder().status(199).body(()).unwrap();
        assert_eq!(interim_head(&head), b"HTTP/1.1 199 \r\n\r\n");
    }

    #[test]
    fn a_transfer_coding_other_than_chunked_has_no_h2_form() {
        let r = request("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
        assert!(!h2_can_carry(&encoded(&r)));
        let r = request("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n");
        assert!(h2_can_carry(&encoded(&r)));
        let r = request("GET / HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(h2_can_carry(&encoded(&r)));
    }

    #[test]
    fn the_response_head_keeps_the_length_or_goes_chunked() {
        let get = request("GET / HTTP/1.1\r\nHost: a\r\n\r\n");
        let (head, framing) = client_head(
            &get,
            200,
            &[("content-length", "12"), ("x-a", "1")],
            false,
            true,
        );
        assert_eq!(framing, Framing::Length(12));
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains("x-a: 1\r\n"), "{head}");
        assert!(
            !head.to_ascii_lowercase().contains("transfer-encoding"),
            "{head}"
        );
        assert!(!head.to_ascii_lowercase().contains("connection"), "{head}");

        // No length: chunked; the client's connection closing is said.
        let (head, framing) = client_head(&get, 404, &[("x-a", "1")], false, false);
        assert_eq!(framing, Framing::Chunked);
        assert!(head.starts_with("HTTP/1.1 404 Not Found\r\n"), "{head}");
        assert!(head.contains("Transfer-Encoding: chunked\r\n"), "{head}");
        assert!(head.contains("Connection: close\r\n"), "{head}");

        // Ended with its head: an empty body by length.
        let (head, framing) = client_head(&get, 200, &[], true, true);
        assert_eq!(framing, Framing::Length(0));
        assert!(head.contains("Content-Length: 0\r\n"), "{head}");

        // Trailers announced to a client that takes them: chunked despite the length.
        let te = request("GET / HTTP/1.1\r\nHost: a\r\nTE: trailers\r\n\r\n");
        let fields = [("content-length", "3"), ("trailer", "x-sum")];
        let (head, framing) = client_head(&te, 200, &fields, false, true);
        assert_eq!(framing, Framing::Chunked);
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        // ... and to one that does not: the length, the trailers dropped.
        let (_, framing) = client_head(&get, 200, &fields, false, true);
        assert_eq!(framing, Framing::Length(3));
    }

    #[test]
    fn bodiless_responses_and_http10_clients() {
        let head_req = request("HEAD / HTTP/1.1\r\nHost: a\r\n\r\n");
        let (head, framing) = client_head(&head_req, 200, &[("content-length", "99")], true, true);
        assert_eq!(framing, Framing::Empty);
        assert!(head.contains("Content-Length: 99\r\n"), "{head}");
        // Without a length from the backend, none is made up.
        let (head, framing) = client_head(&head_req, 200, &[], true, true);
        assert_eq!(framing, Framing::Empty);
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        let (head, _) = client_head(&head_req, 200, &[], false, true);
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        assert!(!head.contains("chunked"), "{head}");
        let get = request("GET / HTTP/1.1\r\nHost: a\r\n\r\n");
        for status in [204, 304] {
            for end in [false, true] {
                let (head, framing) = client_head(&get, status, &[], end, true);
                assert_eq!(framing, Framing::Empty, "{status}");
                assert!(!head.contains("chunked"), "{status}: {head}");
                assert!(!head.contains("Content-Length"), "{status}: {head}");
            }
        }
        // HTTP/1.0 cannot read chunked: to the close, said so.
        let old = request("GET / HTTP/1.0\r\nHost: a\r\nTE: trailers\r\n\r\n");
        let (head, framing) = client_head(&old, 200, &[("trailer", "x")], false, false);
        assert_eq!(framing, Framing::UntilClose);
        assert!(!head.contains("chunked"), "{head}");
        assert!(head.contains("Connection: close\r\n"), "{head}");
        let (head, framing) = client_head(&old, 200, &[("content-length", "4")], false, true);
        assert_eq!(framing, Framing::Length(4));
        assert!(head.contains("Connection: keep-alive\r\n"), "{head}");
    }

    #[test]
    fn trailers_end_the_chunked_body_without_the_forbidden_ones() {
        let mut t = http::HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        t.insert("content-length", "9".parse().unwrap());
        t.insert("set-cookie", "a=b".parse().unwrap());
        t.insert("x-forwarded-for", "6.6.6.6".parse().unwrap());
        t.insert("x-sum", "abc".parse().unwrap());
        let mut out = Vec::new();
        last_chunk(Some(&t), &mut out);
        assert_eq!(out, b"0\r\ngrpc-status: 0\r\nx-sum: abc\r\n\r\n");
        out.clear();
        last_chunk(None, &mut out);
        assert_eq!(out, b"0\r\n\r\n");
    }

    #[test]
    fn relayed_h2_trailers_lose_the_forbidden_ones() {
        let mut t = http::HeaderMap::new();
        t.insert("grpc-status", "7".parse().unwrap());
        t.insert("authorization", "x".parse().unwrap());
        t.append("x-forwarded-for", "6.6.6.6".parse().unwrap());
        let t = relayable_trailers(t).expect("grpc-status is left");
        assert_eq!(t.len(), 1);
        assert_eq!(t["grpc-status"], "7");
        let mut t = http::HeaderMap::new();
        t.insert("set-cookie", "a=b".parse().unwrap());
        assert!(relayable_trailers(t).is_none());
    }
}
