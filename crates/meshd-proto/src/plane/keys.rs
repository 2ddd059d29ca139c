//! Per-direction AES-128-GCM packet keys, their derivation and the key update.
//!
//! Each direction of a link starts from its own 32-byte secret (the IO derives both from
//! the QUIC connection's TLS exporter after meshd's authentication has passed). From a
//! secret come a 16-byte key and a 12-byte IV with HKDF-Expand-Label as in TLS 1.3
//! (RFC 8446 §7.1), and the next secret for a key update the same way (RFC 9001 §6). The
//! nonce of packet `pn` is the IV XOR `pn`, so a nonce repeats only if a packet number
//! does, which the sender never allows under one key.

use ring::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, Tag, UnboundKey};
use ring::hkdf;

/// AES-GCM's confidentiality limit: packets sealed under one key (RFC 9001 §6.6, Appendix
/// B.1.1). The sender stops sealing at this count if a key update has not happened.
pub const CONFIDENTIALITY_LIMIT: u64 = 1 << 23;
/// Default packets sealed under one key before the sender starts a key update: half the
/// limit, so the update completes long before it.
pub const DEFAULT_REKEY_AFTER: u64 = 1 << 22;

const IV_LEN: usize = 12;

/// The two directions' secrets of one link, as the IO derives them. `send` on one end is
/// `recv` on the other.
#[derive(Clone)]
pub struct LinkKeys {
    /// Secret of the packets this end seals.
    pub send: [u8; 32],
    /// Secret of the packets this end opens.
    pub recv: [u8; 32],
}

impl std::fmt::Debug for LinkKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKeys(..)")
    }
}

/// The TLS exporter label (RFC 8446 §7.5) under which the IO exports a link's secrets
/// from the authenticated QUIC connection.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-meshd-plane-v1";

/// The exporter context of one direction's secret on `lane`: each lane and direction gets
/// its own 32 bytes, so no two of them ever share a key.
pub fn exporter_context(lane: u8, client_to_server: bool) -> [u8; 2] {
    [lane, client_to_server as u8]
}

/// The exporter context of a link's name: 8 bytes both ends of one connection derive
/// alike, by which both ends of two connections between the same nodes choose the same one
/// to carry their datagrams (the one whose name is lowest).
pub const LINK_NAME_CONTEXT: &[u8] = b"link name";

impl LinkKeys {
    /// The keys of the QUIC client's or server's end, from the two exported secrets.
    pub fn for_side(client_to_server: [u8; 32], server_to_client: [u8; 32], is_client: bool) -> LinkKeys {
        if is_client {
            LinkKeys { send: client_to_server, recv: server_to_client }
        } else {
            LinkKeys { send: server_to_client, recv: client_to_server }
        }
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label(secret, label, "", out.len()) with SHA-256 (RFC 8446 §7.1).
fn expand_label(secret: &[u8; 32], label: &[u8], out: &mut [u8]) {
    let prk = hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, secret);
    let len = (out.len() as u16).to_be_bytes();
    let label_len = [(6 + label.len()) as u8];
    let info: [&[u8]; 5] = [&len, &label_len, b"tls13 ", label, &[0]];
    // Only fails for outputs over 255 hash lengths; every call here asks for at most 32 bytes.
    if let Ok(okm) = prk.expand(&info, Len(out.len())) {
        let _ = okm.fill(out);
    }
}

/// The link id of the datagrams sealed from `secret` (a direction's initial secret): 8
/// bytes of HKDF-Expand-Label(secret, "meshd plane cid", "", 8), so both ends of the
/// direction compute it and nobody else can. It is sent in clear in every datagram's
/// header and stays the same across key updates.
pub fn link_id(secret: &[u8; 32]) -> u64 {
    let mut id = [0u8; 8];
    expand_label(secret, b"meshd plane cid", &mut id);
    u64::from_be_bytes(id)
}

impl LinkKeys {
    /// The link id this end writes into the datagrams it seals.
    pub fn send_id(&self) -> u64 {
        link_id(&self.send)
    }

    /// The link id of the datagrams this end opens: any other id is not this link's.
    pub fn recv_id(&self) -> u64 {
        link_id(&self.recv)
    }
}

/// The secret after a key update.
pub fn next_secret(secret: &[u8; 32]) -> [u8; 32] {
    let mut next = [0u8; 32];
    expand_label(secret, b"meshd plane ku", &mut next);
    next
}

/// One AEAD key and IV.
pub struct PacketKey {
    key: LessSafeKey,
    iv: [u8; IV_LEN],
}

impl std::fmt::Debug for PacketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PacketKey(..)")
    }
}

impl PacketKey {
    /// The key and IV derived from `secret`.
    pub fn from_secret(secret: &[u8; 32]) -> PacketKey {
        let mut key = [0u8; 16];
        let mut iv = [0u8; IV_LEN];
        expand_label(secret, b"meshd plane key", &mut key);
        expand_label(secret, b"meshd plane iv", &mut iv);
        // A 16-byte key is exactly what AES-128-GCM takes, so this cannot fail.
        let unbound = UnboundKey::new(&AES_128_GCM, &key).unwrap_or_else(|_| unreachable!());
        PacketKey { key: LessSafeKey::new(unbound), iv }
    }

    fn nonce(&self, pn: u64) -> Nonce {
        let mut n = self.iv;
        for (b, p) in n[IV_LEN - 8..].iter_mut().zip(pn.to_be_bytes()) {
            *b ^= p;
        }
        Nonce::assume_unique_for_key(n)
    }

    /// Encrypts `payload` in place; `header` is authenticated. Returns the tag.
    pub fn seal(&self, pn: u64, header: &[u8], payload: &mut [u8]) -> Tag {
        // ring fails only for inputs over GCM's 2^36-byte per-message limit; datagrams are
        // under 64 KiB.
        self.key
            .seal_in_place_separate_tag(self.nonce(pn), Aad::from(header), payload)
            .unwrap_or_else(|_| unreachable!())
    }

    /// Decrypts `ciphertext_and_tag` in place and returns the plaintext, or `None` when the
    /// tag does not verify (the buffer's contents are then unspecified).
    pub fn open<'a>(&self, pn: u64, header: &[u8], ciphertext_and_tag: &'a mut [u8]) -> Option<&'a mut [u8]> {
        self.key.open_in_place(self.nonce(pn), Aad::from(header), ciphertext_and_tag).ok()
    }
}

/// The sending direction's key state.
#[derive(Debug)]
pub struct SendKeys {
    secret: [u8; 32],
    key: PacketKey,
    phase: bool,
    sealed: u64,
    phase_first_pn: u64,
    phase_acked: bool,
    updates: u64,
}

impl SendKeys {
    /// Keys for the first phase, from the initial secret.
    pub fn new(secret: [u8; 32]) -> SendKeys {
        SendKeys {
            key: PacketKey::from_secret(&secret),
            secret,
            phase: false,
            sealed: 0,
            phase_first_pn: 0,
            // The first phase needs no acknowledgement: the peer starts in it.
            phase_acked: true,
            updates: 0,
        }
    }

    /// The key phase bit of the current key.
    pub fn phase(&self) -> bool {
        self.phase
    }

    /// Packets sealed under the current key.
    pub fn sealed(&self) -> u64 {
        self.sealed
    }

    /// Key updates so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Records that the peer acknowledged packet `pn`: once it acknowledges one of the
    /// current phase it has the current key, and the next update may start (RFC 9001 §6.1).
    pub fn on_acked(&mut self, pn: u64) {
        if pn >= self.phase_first_pn {
            self.phase_acked = true;
        }
    }

    /// Moves to the next key if `rekey_after` packets went out under this one and the peer
    /// has shown it holds this one; `next_pn` is the number the next packet will carry.
    pub fn maybe_update(&mut self, rekey_after: u64, next_pn: u64) {
        if self.sealed < rekey_after || !self.phase_acked {
            return;
        }
        self.secret = next_secret(&self.secret);
        self.key = PacketKey::from_secret(&self.secret);
        self.phase = !self.phase;
        self.sealed = 0;
        self.phase_first_pn = next_pn;
        self.phase_acked = false;
        self.updates += 1;
    }

    /// Whether one more packet may be sealed under the current key.
    pub fn can_seal(&self) -> bool {
        self.sealed < CONFIDENTIALITY_LIMIT
    }

    /// Seals one packet, counting it against the key's limit.
    pub fn seal(&mut self, pn: u64, header: &[u8], payload: &mut [u8]) -> Tag {
        self.sealed += 1;
        self.key.seal(pn, header, payload)
    }
}

/// Which receive key opens a datagram, decided before any state changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyChoice {
    /// The previous phase's key (a late packet from before the peer's last update).
    Previous,
    /// The current key.
    Current,
    /// The next key: the peer has updated; success commits the update.
    Next,
}

/// The receiving direction's key state: previous, current and next keys, as RFC 9001 §6.
#[derive(Debug)]
pub struct RecvKeys {
    previous: Option<PacketKey>,
    current: PacketKey,
    next: PacketKey,
    next_secret: [u8; 32],
    phase: bool,
    phase_first_pn: Option<u64>,
    updates: u64,
}

impl RecvKeys {
    /// Keys for the first phase, from the initial secret.
    pub fn new(secret: [u8; 32]) -> RecvKeys {
        let next_secret = next_secret(&secret);
        RecvKeys {
            previous: None,
            current: PacketKey::from_secret(&secret),
            next: PacketKey::from_secret(&next_secret),
            next_secret,
            phase: false,
            phase_first_pn: None,
            updates: 0,
        }
    }

    /// Key updates the peer has made.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Picks the key for a datagram of phase `phase` and number `pn`, or `None` when no key
    /// can open it (a phase older than the previous one).
    pub fn choose(&self, phase: bool, pn: u64) -> Option<KeyChoice> {
        if phase == self.phase {
            return Some(KeyChoice::Current);
        }
        match self.phase_first_pn {
            Some(first) if pn < first => self.previous.as_ref().map(|_| KeyChoice::Previous),
            _ => Some(KeyChoice::Next),
        }
    }

    /// The key behind `choice`.
    pub fn key(&self, choice: KeyChoice) -> Option<&PacketKey> {
        match choice {
            KeyChoice::Previous => self.previous.as_ref(),
            KeyChoice::Current => Some(&self.current),
            KeyChoice::Next => Some(&self.next),
        }
    }

    /// Commits what opening packet `pn` with `choice` implies: after the next key opened a
    /// datagram, it becomes current and a new next key is derived.
    pub fn commit(&mut self, choice: KeyChoice, pn: u64) {
        match choice {
            KeyChoice::Previous => {}
            KeyChoice::Current => {
                if self.phase_first_pn.is_none_or(|f| pn < f) {
                    self.phase_first_pn = Some(pn);
                }
            }
            KeyChoice::Next => {
                let following = next_secret(&self.next_secret);
                let next = PacketKey::from_secret(&following);
                let current = std::mem::replace(&mut self.next, next);
                self.previous = Some(std::mem::replace(&mut self.current, current));
                self.next_secret = following;
                self.phase = !self.phase;
                self.phase_first_pn = Some(pn);
                self.updates += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_round_trip_and_tamper_detection() {
        let key = PacketKey::from_secret(&[7u8; 32]);
        let header = [0x20, 0, 0, 0, 0, 5];
        let mut buf = b"hello plane".to_vec();
        let tag = key.seal(5, &header, &mut buf);
        buf.extend_from_slice(tag.as_ref());
        let mut copy = buf.clone();
        assert_eq!(key.open(5, &header, &mut copy).expect("opens"), b"hello plane");
        let mut wrong_pn = buf.clone();
        assert!(key.open(6, &header, &mut wrong_pn).is_none());
        let mut wrong_header = buf.clone();
        assert!(key.open(5, &[0x21, 0, 0, 0, 0, 5], &mut wrong_header).is_none());
        let other = PacketKey::from_secret(&[8u8; 32]);
        assert!(other.open(5, &header, &mut buf).is_none());
    }

    #[test]
    fn the_two_sides_of_a_connection_get_mirrored_keys() {
        let (c2s, s2c) = ([1u8; 32], [2u8; 32]);
        let client = LinkKeys::for_side(c2s, s2c, true);
        let server = LinkKeys::for_side(c2s, s2c, false);
        assert_eq!((client.send, client.recv), (server.recv, server.send));
        assert_eq!((client.send_id(), client.recv_id()), (server.recv_id(), server.send_id()));
        assert_ne!(client.send_id(), client.recv_id(), "each direction has its own id");
        assert_ne!(exporter_context(0, true), exporter_context(0, false));
        assert_ne!(exporter_context(0, true), exporter_context(1, true));
    }

    #[test]
    fn key_update_chains_match_on_both_ends() {
        let mut send = SendKeys::new([1u8; 32]);
        let mut recv = RecvKeys::new([1u8; 32]);
        let header = [0x20u8; 6];
        for pn in 0..10u64 {
            send.maybe_update(3, pn);
            let mut buf = vec![pn as u8; 20];
            let tag = send.seal(pn, &header, &mut buf);
            buf.extend_from_slice(tag.as_ref());
            send.on_acked(pn);
            let choice = recv.choose(send.phase(), pn).expect("a key");
            let key = recv.key(choice).expect("present");
            assert!(key.open(pn, &header, &mut buf).is_some(), "pn {pn}");
            recv.commit(choice, pn);
        }
        assert_eq!(send.updates(), 3);
        assert_eq!(recv.updates(), 3);
    }

    #[test]
    fn no_second_update_before_the_peer_acknowledges_the_first() {
        let mut send = SendKeys::new([1u8; 32]);
        for pn in 0..4 {
            let _ = send.seal(pn, &[0; 6], &mut []);
        }
        send.maybe_update(2, 4);
        assert_eq!(send.updates(), 1);
        for pn in 4..8 {
            let _ = send.seal(pn, &[0; 6], &mut []);
        }
        send.maybe_update(2, 8);
        assert_eq!(send.updates(), 1, "no ack of phase 1 yet");
        send.on_acked(3);
        send.maybe_update(2, 8);
        assert_eq!(send.updates(), 1, "an ack of the old phase does not count");
        send.on_acked(4);
        send.maybe_update(2, 8);
        assert_eq!(send.updates(), 2);
    }
}
