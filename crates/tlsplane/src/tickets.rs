//! Session-ticket keys that outlive the process and are shared by a fleet.
//!
//! rustls's own ticketer makes random keys in each process, so a ticket resumes only on the
//! process that issued it, and not after a restart. [`TicketKeyRing`] instead encrypts tickets
//! under keys given to it (`--ticket-keys FILE`, or the fleet's store), installed again
//! whenever they change, so that every server holding the same keys resumes every other's
//! tickets.
//!
//! The keys follow HAProxy's `tls-ticket-keys` rotation: of the keys given, the last three
//! count, and the one before the last encrypts. So the keys are *previous, current, next*: a
//! rotation appends a key and drops the first, and because every server learns the next key
//! one rotation before any of them encrypts with it, a ticket issued by a server that rotated
//! first still resumes on one that has not.
//!
//! A ticket is `key name (16) ‖ issuer id (8) ‖ nonce (12) ‖ AES-256-GCM(rustls's session
//! state) ‖ tag (16)`, with the name and the id as associated data. The name picks the key,
//! so a ticket costs at most one decryption whatever it holds. The issuer id is random per
//! process, and each process seals under a subkey of its own, derived by HKDF-SHA256 from the
//! key's secret and its id: with random 96-bit nonces an AES-GCM key may seal 2^32 messages
//! (NIST SP 800-38D), which a fleet sharing one key would reach, while one process seals far
//! fewer, and draws a new id before it could. Any server holding the key derives the subkey
//! from the id in the ticket (and keeps it for the next ticket of that issuer, once one
//! opened). The id also tells a resumption of this process's ticket from one issued elsewhere
//! in the fleet (`handshakes_resumed_local`, `handshakes_resumed_remote`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use aws_lc_rs::aead::{Aad, Nonce, RandomizedNonceKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::hkdf;
use base64::Engine as _;
use rustls::server::ProducesTickets;
use zeroize::Zeroizing;

/// Bytes of a key's name, at the front of each ticket it encrypts.
pub const KEY_NAME_LEN: usize = 16;
/// Lengths a key may have, as `openssl rand 80` (or 48) makes them, and as nginx's
/// `ssl_session_ticket_key` and HAProxy's `tls-ticket-keys` take them: a 16-byte name, then
/// the secret.
pub const KEY_LENS: [usize; 2] = [48, 80];
/// Keys that count: previous, current (encrypts) and next.
pub const KEYS_USED: usize = 3;
/// Seconds a ticket is announced for. Keys should rotate no more often: a ticket issued just
/// before a rotation is then still decrypted (under the previous key) for as long as the
/// client may offer it.
pub const TICKET_LIFETIME: u32 = 6 * 3600;
/// HKDF info of a subkey, followed by the issuer's id: the AEAD key is derived from a key's
/// secret, so the same file can never be used as the raw key of another cipher by mistake.
const KDF_INFO: &[u8] = b"tlsplane session ticket v2 issuer ";
/// Bytes of the issuer's id, after the key's name in each ticket.
pub const ISSUER_ID_LEN: usize = 8;
/// Tickets a process seals under one subkey before it draws a new id: half the 2^32
/// sealings with random nonces that NIST SP 800-38D allows one AES-GCM key.
const SEALS_PER_SUBKEY: u64 = 1 << 31;
/// Subkeys of issuers kept per key (those of tickets that opened): more than a fleet has
/// processes in one key's life; the cache is emptied when full.
const SUBKEYS_KEPT: usize = 4096;
/// This process's ids kept, to tell its own tickets (after it drew a new one).
const OWN_IDS_KEPT: usize = 8;
const TAG_LEN: usize = 16;

/// Why a set of ticket keys was refused.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TicketKeyError {
    Empty,
    NotBase64 { line: usize },
    Length { line: usize, len: usize },
    DuplicateName { line: usize, first: usize },
}

impl std::fmt::Display for TicketKeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Empty => write!(
                f,
                "no ticket key in it (one base64 key per line, e.g. `openssl rand 80 | base64 -w0`)"
            ),
            Self::NotBase64 { line } => write!(f, "line {line}: not base64"),
            Self::Length { line, len } => write!(
                f,
                "line {line}: a key is 48 or 80 bytes (`openssl rand 80 | base64 -w0`), this one is {len}"
            ),
            Self::DuplicateName { line, first } => write!(
                f,
                "line {line}: the same key name as line {first}: keys must be independent random bytes"
            ),
        }
    }
}

impl std::error::Error for TicketKeyError {}

/// One key: its name, its secret, and the subkeys derived from it so far.
struct TicketKey {
    name: [u8; KEY_NAME_LEN],
    /// Zeroized when the key is dropped.
    secret: Zeroizing<Vec<u8>>,
    subkeys: RwLock<HashMap<IssuerId, Arc<RandomizedNonceKey>>>,
}

type IssuerId = [u8; ISSUER_ID_LEN];

impl TicketKey {
    fn new(raw: &[u8]) -> Self {
        let mut name = [0u8; KEY_NAME_LEN];
        name.copy_from_slice(&raw[..KEY_NAME_LEN]);
        Self {
            name,
            secret: Zeroizing::new(raw[KEY_NAME_LEN..].to_vec()),
            subkeys: RwLock::default(),
        }
    }

    /// The subkey of issuer `id`, if derived before.
    fn known_subkey(&self, id: &IssuerId) -> Option<Arc<RandomizedNonceKey>> {
        let subkeys = self.subkeys.read().unwrap_or_else(|e| e.into_inner());
        subkeys.get(id).cloned()
    }

    /// The subkey of issuer `id`: HKDF-SHA256 of the key's secret, with the id in the info.
    fn derive_subkey(&self, id: &IssuerId) -> Arc<RandomizedNonceKey> {
        let info = [KDF_INFO, &id[..]].concat();
        Arc::new(derive_aead_key(&self.secret, &info))
    }

    /// Keeps `subkey` of issuer `id` for its next tickets: only subkeys of this process and
    /// of tickets that opened, so that made-up ids cannot fill the cache.
    fn keep_subkey(&self, id: IssuerId, subkey: Arc<RandomizedNonceKey>) {
        let mut subkeys = self.subkeys.write().unwrap_or_else(|e| e.into_inner());
        if subkeys.len() >= SUBKEYS_KEPT {
            subkeys.clear();
        }
        subkeys.insert(id, subkey);
    }

    /// The associated data of a ticket: the key's name and the issuer's id.
    fn aad(&self, id: &IssuerId) -> [u8; KEY_NAME_LEN + ISSUER_ID_LEN] {
        let mut aad = [0u8; KEY_NAME_LEN + ISSUER_ID_LEN];
        aad[..KEY_NAME_LEN].copy_from_slice(&self.name);
        aad[KEY_NAME_LEN..].copy_from_slice(id);
        aad
    }
}

/// An AES-256-GCM key derived from `secret` by HKDF-SHA256 (no salt) with `info`, which
/// names what the key is for, so that one secret never keys two purposes. The derived bytes
/// are zeroized; the key lives inside aws-lc.
pub fn derive_aead_key(secret: &[u8], info: &[u8]) -> RandomizedNonceKey {
    let key = derive_key(secret, info);
    RandomizedNonceKey::new(&AES_256_GCM, &key[..]).expect("a 32-byte key")
}

/// 32 bytes derived from `secret` by HKDF-SHA256 (no salt) with `info`, zeroized when dropped.
pub fn derive_key(secret: &[u8], info: &[u8]) -> Zeroizing<[u8; 32]> {
    struct Len32;
    impl hkdf::KeyType for Len32 {
        fn len(&self) -> usize {
            32
        }
    }
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(secret);
    let mut key = Zeroizing::new([0u8; 32]);
    // The lengths are fixed (32 bytes out of HKDF-SHA256), so neither step can fail.
    prk.expand(&[info], Len32)
        .and_then(|okm| okm.fill(&mut key[..]))
        .expect("HKDF-SHA256 gives 32 bytes");
    key
}

/// The keys in use: previous (may be absent), current, next (may be absent).
pub struct TicketKeys {
    keys: Vec<TicketKey>,
    /// Index of the key that encrypts.
    current: usize,
    /// Tickets sealed under the current key's subkey of this process's newest id.
    sealed: AtomicU64,
}

impl std::fmt::Debug for TicketKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: they are sent in every ticket anyway. Never the secrets.
        f.debug_struct("TicketKeys")
            .field("keys", &self.keys.len())
            .field("current", &self.current)
            .finish()
    }
}

impl TicketKeys {
    /// Keys from their raw bytes, oldest first (each 48 or 80 bytes: name, then secret).
    /// The last [`KEYS_USED`] count and the one before the last encrypts (the only one, if
    /// there is one).
    pub fn from_raw<K: AsRef<[u8]>>(raw: &[K]) -> Result<Self, TicketKeyError> {
        if raw.is_empty() {
            return Err(TicketKeyError::Empty);
        }
        let first_used = raw.len().saturating_sub(KEYS_USED);
        let mut keys: Vec<TicketKey> = Vec::with_capacity(KEYS_USED);
        for (i, k) in raw.iter().enumerate() {
            let k = k.as_ref();
            if !KEY_LENS.contains(&k.len()) {
                return Err(TicketKeyError::Length {
                    line: i + 1,
                    len: k.len(),
                });
            }
            if i < first_used {
                continue;
            }
            let key = TicketKey::new(k);
            if let Some(j) = keys.iter().position(|o| o.name == key.name) {
                return Err(TicketKeyError::DuplicateName {
                    line: i + 1,
                    first: first_used + j + 1,
                });
            }
            keys.push(key);
        }
        let current = keys.len().saturating_sub(2);
        Ok(Self {
            keys,
            current,
            sealed: AtomicU64::new(0),
        })
    }

    /// Keys from a file's text: one base64 key per line, oldest first; blank lines and lines
    /// starting with `#` are skipped. The text is the caller's to zeroize.
    pub fn parse(text: &str) -> Result<Self, TicketKeyError> {
        let mut raw: Vec<Zeroizing<Vec<u8>>> = Vec::new();
        let mut lines: Vec<usize> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut key = Zeroizing::new(Vec::with_capacity(81));
            base64::engine::general_purpose::STANDARD
                .decode_vec(line, &mut key)
                .map_err(|_| TicketKeyError::NotBase64 { line: n + 1 })?;
            raw.push(key);
            lines.push(n + 1);
        }
        // Errors name the file's line, not the key's place.
        Self::from_raw(&raw).map_err(|e| match e {
            TicketKeyError::Length { line, len } => TicketKeyError::Length {
                line: lines[line - 1],
                len,
            },
            TicketKeyError::DuplicateName { line, first } => TicketKeyError::DuplicateName {
                line: lines[line - 1],
                first: lines[first - 1],
            },
            e => e,
        })
    }

    /// Keys held (1 to 3).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The name of the key that encrypts new tickets (it is in each ticket, not a secret).
    pub fn current_name(&self) -> [u8; KEY_NAME_LEN] {
        self.keys[self.current].name
    }

    /// Seals `plain` under the current key's subkey of issuer `id`.
    fn encrypt(&self, id: &IssuerId, plain: &[u8]) -> Option<Vec<u8>> {
        let key = &self.keys[self.current];
        let subkey = key.known_subkey(id).unwrap_or_else(|| {
            let subkey = key.derive_subkey(id);
            key.keep_subkey(*id, subkey.clone());
            subkey
        });
        let head = KEY_NAME_LEN + ISSUER_ID_LEN;
        let mut out = Vec::with_capacity(head + NONCE_LEN + plain.len() + TAG_LEN);
        out.extend_from_slice(&key.name);
        out.extend_from_slice(id);
        // Plaintext until sealed, if sealing fails.
        let mut body = Zeroizing::new(Vec::with_capacity(plain.len() + TAG_LEN));
        body.extend_from_slice(plain);
        let nonce = subkey
            .seal_in_place_append_tag(Aad::from(key.aad(id)), &mut *body)
            .ok()?;
        out.extend_from_slice(nonce.as_ref());
        out.extend_from_slice(&body);
        Some(out)
    }

    /// Opens `ticket`: its plaintext, and the id of its issuer.
    fn decrypt(&self, ticket: &[u8]) -> Option<(Vec<u8>, IssuerId)> {
        if ticket.len() < KEY_NAME_LEN + ISSUER_ID_LEN + NONCE_LEN + TAG_LEN {
            return None;
        }
        let (name, rest) = ticket.split_at(KEY_NAME_LEN);
        let (id, rest) = rest.split_at(ISSUER_ID_LEN);
        let id: IssuerId = id.try_into().expect("ISSUER_ID_LEN bytes");
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let key = self.keys.iter().find(|k| k.name == name)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let (subkey, known) = match key.known_subkey(&id) {
            Some(k) => (k, true),
            None => (key.derive_subkey(&id), false),
        };
        let mut body = sealed.to_vec();
        let plain_len = subkey
            .open_in_place(nonce, Aad::from(key.aad(&id)), &mut body)
            .ok()?
            .len();
        body.truncate(plain_len);
        if !known {
            key.keep_subkey(id, subkey);
        }
        Some((body, id))
    }
}

/// The ticketer of every site: encrypts and decrypts with the keys installed last.
/// Cheap to share (`Arc`); a new set of keys is installed without a new rustls configuration.
#[derive(Debug)]
pub struct TicketKeyRing {
    keys: RwLock<Arc<TicketKeys>>,
    /// Seconds tickets are announced for: at most the time between rotations.
    lifetime: u32,
    /// This process's issuer ids, the one it seals under last (a new one is drawn when it
    /// has sealed [`SEALS_PER_SUBKEY`] tickets under one key).
    ids: RwLock<Vec<IssuerId>>,
}

/// Who issued a ticket of the shared keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TicketIssuer {
    /// This process.
    Here,
    /// Another process holding the same keys: another server, or this one before a restart.
    Elsewhere,
}

fn random_id() -> IssuerId {
    let mut id = [0u8; ISSUER_ID_LEN];
    aws_lc_rs::rand::fill(&mut id).expect("the system's random source");
    id
}

impl TicketKeyRing {
    pub fn new(keys: Arc<TicketKeys>) -> Arc<Self> {
        Self::with_lifetime(keys, TICKET_LIFETIME)
    }

    /// A ring whose keys rotate every `lifetime` seconds (or more seldom): tickets are
    /// announced for that long.
    pub fn with_lifetime(keys: Arc<TicketKeys>, lifetime: u32) -> Arc<Self> {
        Arc::new(Self {
            keys: RwLock::new(keys),
            lifetime: lifetime.clamp(1, TICKET_LIFETIME),
            ids: RwLock::new(vec![random_id()]),
        })
    }

    /// Installs `keys`: tickets are encrypted with their current key from now on, and
    /// decrypted with any of them (a ticket under a key no longer held gets a full handshake).
    pub fn install(&self, keys: Arc<TicketKeys>) {
        let mut held = self.keys.write().unwrap_or_else(|e| e.into_inner());
        // The same current key again (a reload): its subkey's count goes on.
        if held.current_name() == keys.current_name() {
            keys.sealed.store(held.sealed.load(Relaxed), Relaxed);
        }
        *held = keys;
    }

    /// The keys in use.
    pub fn keys(&self) -> Arc<TicketKeys> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The id this process seals under now, drawn anew once the current key's subkey of the
    /// last one has sealed its share.
    fn sealing_id(&self, keys: &TicketKeys) -> IssuerId {
        if keys.sealed.fetch_add(1, Relaxed) >= SEALS_PER_SUBKEY {
            let mut ids = self.ids.write().unwrap_or_else(|e| e.into_inner());
            if keys.sealed.swap(1, Relaxed) >= SEALS_PER_SUBKEY {
                ids.push(random_id());
                let excess = ids.len().saturating_sub(OWN_IDS_KEPT);
                ids.drain(..excess);
            }
        }
        let ids = self.ids.read().unwrap_or_else(|e| e.into_inner());
        *ids.last().expect("a ring has an id")
    }

    fn issued_here(&self, id: &IssuerId) -> bool {
        let ids = self.ids.read().unwrap_or_else(|e| e.into_inner());
        ids.contains(id)
    }

    /// Who issued `ticket`, if it opens under the keys held (what rustls's decryption will
    /// then find, short of a key installed in between).
    pub fn issuer_of(&self, ticket: &[u8]) -> Option<TicketIssuer> {
        let (plain, id) = self.keys().decrypt(ticket)?;
        // The session state holds the resumption secret.
        drop(Zeroizing::new(plain));
        match self.issued_here(&id) {
            true => Some(TicketIssuer::Here),
            false => Some(TicketIssuer::Elsewhere),
        }
    }
}

impl ProducesTickets for TicketKeyRing {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        self.lifetime
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let keys = self.keys();
        keys.encrypt(&self.sealing_id(&keys), plain)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.keys().decrypt(cipher).map(|(plain, _)| plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u8) -> Vec<u8> {
        (0..80)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i))
            .collect()
    }

    fn b64(k: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(k)
    }

    const ID: IssuerId = *b"issuer-1";

    /// `keys` opening `ticket`: its plaintext alone.
    fn open(keys: &TicketKeys, ticket: &[u8]) -> Option<Vec<u8>> {
        keys.decrypt(ticket).map(|(plain, _)| plain)
    }

    #[test]
    fn a_ticket_decrypts_under_the_same_keys_and_not_under_others() {
        let a = TicketKeys::from_raw(&[key(1)]).unwrap();
        let same = TicketKeys::from_raw(&[key(1)]).unwrap();
        let other = TicketKeys::from_raw(&[key(2)]).unwrap();
        let t = a.encrypt(&ID, b"session state").unwrap();
        assert_eq!(&t[..KEY_NAME_LEN], &key(1)[..KEY_NAME_LEN]);
        assert_eq!(
            same.decrypt(&t),
            Some((b"session state".to_vec(), ID)),
            "a server that never saw the issuer derives its subkey"
        );
        assert_eq!(open(&other, &t), None);
        // Two tickets of the same state differ (random nonces).
        assert_ne!(a.encrypt(&ID, b"session state").unwrap(), t);
    }

    #[test]
    fn rings_tell_their_own_tickets_from_the_fleets() {
        let keys = || Arc::new(TicketKeys::from_raw(&[key(1)]).unwrap());
        let (a, b) = (TicketKeyRing::new(keys()), TicketKeyRing::new(keys()));
        let t = ProducesTickets::encrypt(&*a, b"state").unwrap();
        assert_eq!(
            ProducesTickets::decrypt(&*a, &t).as_deref(),
            Some(&b"state"[..])
        );
        assert_eq!(
            ProducesTickets::decrypt(&*b, &t).as_deref(),
            Some(&b"state"[..])
        );
        assert_eq!(a.issuer_of(&t), Some(TicketIssuer::Here));
        assert_eq!(b.issuer_of(&t), Some(TicketIssuer::Elsewhere));
        let other = TicketKeyRing::new(Arc::new(TicketKeys::from_raw(&[key(2)]).unwrap()));
        assert_eq!(other.issuer_of(&t), None);
        // The issuer's id is authenticated: A's ticket named as B's opens nowhere.
        let b_id = ProducesTickets::encrypt(&*b, b"x").unwrap()[16..24].to_vec();
        let mut forged = t.clone();
        forged[16..24].copy_from_slice(&b_id);
        assert_eq!(ProducesTickets::decrypt(&*b, &forged), None);
        assert_eq!(b.issuer_of(&forged), None);
    }

    #[test]
    fn each_issuer_seals_under_a_subkey_of_its_own() {
        // As docs/FLEET.md gives it: name (16) ‖ id (8) ‖ nonce (12) ‖ sealed ‖ tag (16), under
        // HKDF-SHA256(no salt, the key's secret, "tlsplane session ticket v2 issuer " ‖ id).
        let raw = key(1);
        let keys = || Arc::new(TicketKeys::from_raw(&[&raw]).unwrap());
        let open_as = |t: &[u8], id: &[u8]| -> Option<Vec<u8>> {
            let info = [&b"tlsplane session ticket v2 issuer "[..], id].concat();
            let aead = derive_aead_key(&raw[16..], &info);
            let aad = [&t[..16], id].concat();
            let nonce = Nonce::try_assume_unique_for_key(&t[24..36]).unwrap();
            let mut body = t[36..].to_vec();
            let n = aead
                .open_in_place(nonce, Aad::from(aad), &mut body)
                .ok()?
                .len();
            body.truncate(n);
            Some(body)
        };
        let (a, b) = (TicketKeyRing::new(keys()), TicketKeyRing::new(keys()));
        let a1 = ProducesTickets::encrypt(&*a, b"one").unwrap();
        let a2 = ProducesTickets::encrypt(&*a, b"two").unwrap();
        let b1 = ProducesTickets::encrypt(&*b, b"three").unwrap();
        assert_eq!(a1.len(), 16 + 8 + 12 + 3 + 16);
        assert_eq!(a1[16..24], a2[16..24], "one id per process");
        assert_ne!(a1[16..24], b1[16..24]);
        assert_eq!(open_as(&a1, &a1[16..24]).as_deref(), Some(&b"one"[..]));
        assert_eq!(open_as(&b1, &b1[16..24]).as_deref(), Some(&b"three"[..]));
        // Another issuer's subkey opens none of A's tickets.
        assert_eq!(open_as(&a1, &b1[16..24]), None);
    }

    #[test]
    fn a_process_draws_a_new_id_before_its_subkey_seals_too_many() {
        let keys = || Arc::new(TicketKeys::from_raw(&[key(1), key(2)]).unwrap());
        let ring = TicketKeyRing::new(keys());
        let first = ProducesTickets::encrypt(&*ring, b"a").unwrap();
        // A reload with the same current key keeps counting.
        ring.keys().sealed.store(SEALS_PER_SUBKEY, Relaxed);
        ring.install(keys());
        let second = ProducesTickets::encrypt(&*ring, b"b").unwrap();
        assert_ne!(first[16..24], second[16..24], "a new id");
        let third = ProducesTickets::encrypt(&*ring, b"c").unwrap();
        assert_eq!(second[16..24], third[16..24]);
        // Its tickets under the id before are still its own, and open.
        assert_eq!(ring.issuer_of(&first), Some(TicketIssuer::Here));
        assert_eq!(ring.issuer_of(&second), Some(TicketIssuer::Here));
        assert_eq!(ring.decrypt(&first).as_deref(), Some(&b"a"[..]));
        // Another current key: a subkey of its own, counted from nothing.
        ring.install(Arc::new(
            TicketKeys::from_raw(&[key(1), key(2), key(3)]).unwrap(),
        ));
        assert_eq!(ring.keys().sealed.load(Relaxed), 0);
    }

    #[test]
    fn a_changed_byte_anywhere_fails_the_ticket() {
        let k = TicketKeys::from_raw(&[key(1)]).unwrap();
        let t = k.encrypt(&ID, b"0123456789").unwrap();
        for i in 0..t.len() {
            let mut bad = t.clone();
            bad[i] ^= 1;
            assert_eq!(open(&k, &bad), None, "byte {i}");
        }
        for n in 0..t.len() {
            assert_eq!(open(&k, &t[..n]), None, "cut at {n}");
        }
        assert_eq!(open(&k, &t).as_deref(), Some(&b"0123456789"[..]));
    }

    #[test]
    fn the_key_before_the_last_encrypts_and_the_last_three_decrypt() {
        let (k1, k2, k3, k4) = (key(1), key(2), key(3), key(4));
        let one = TicketKeys::from_raw(&[&k1]).unwrap();
        assert_eq!(one.current_name(), k1[..16]);
        let two = TicketKeys::from_raw(&[&k1, &k2]).unwrap();
        assert_eq!(
            two.current_name(),
            k1[..16],
            "the second key is the next one"
        );
        let three = TicketKeys::from_raw(&[&k1, &k2, &k3]).unwrap();
        assert_eq!(three.current_name(), k2[..16]);
        let four = TicketKeys::from_raw(&[&k1, &k2, &k3, &k4]).unwrap();
        assert_eq!(four.current_name(), k3[..16]);
        assert_eq!(four.len(), 3);
        // A rotation: the ticket of the old current key decrypts after one, not after two.
        let t = two.encrypt(&ID, b"x").unwrap();
        assert!(three.decrypt(&t).is_some());
        assert!(four.decrypt(&t).is_none());
        // A ticket of a server that rotated first decrypts on one that has not.
        let ahead = three.encrypt(&ID, b"y").unwrap();
        assert_eq!(open(&two, &ahead).as_deref(), Some(&b"y"[..]));
    }

    #[test]
    fn the_file_format_is_base64_lines_with_comments() {
        let text = format!(
            "# rotated by cron\n{}\n\n  {}  \n{}\n",
            b64(&key(1)),
            b64(&key(2)),
            b64(&key(3)[..48])
        );
        let k = TicketKeys::parse(&text).unwrap();
        assert_eq!(k.len(), 3);
        assert_eq!(k.current_name(), key(2)[..16]);
        assert_eq!(
            TicketKeys::parse("\n# none\n").unwrap_err(),
            TicketKeyError::Empty
        );
        assert_eq!(
            TicketKeys::parse(&format!("{}\nnot base64!\n", b64(&key(1)))).unwrap_err(),
            TicketKeyError::NotBase64 { line: 2 }
        );
        assert_eq!(
            TicketKeys::parse(&format!("# c\n{}\n", b64(&key(1)[..32]))).unwrap_err(),
            TicketKeyError::Length { line: 2, len: 32 }
        );
        assert_eq!(
            TicketKeys::parse(&format!("{}\n\n{}\n", b64(&key(1)), b64(&key(1)))).unwrap_err(),
            TicketKeyError::DuplicateName { line: 3, first: 1 }
        );
    }

    #[test]
    fn installing_keys_changes_what_the_ring_encrypts_with() {
        let ring = TicketKeyRing::new(Arc::new(TicketKeys::from_raw(&[key(1), key(2)]).unwrap()));
        let before = ring.encrypt(b"a").unwrap();
        ring.install(Arc::new(
            TicketKeys::from_raw(&[key(1), key(2), key(3)]).unwrap(),
        ));
        let after = ring.encrypt(b"b").unwrap();
        assert_eq!(&before[..16], &key(1)[..16]);
        assert_eq!(&after[..16], &key(2)[..16]);
        assert_eq!(ring.decrypt(&before).as_deref(), Some(&b"a"[..]));
        assert!(format!("{:?}", ring.keys()).contains("keys: 3"));
    }
}
