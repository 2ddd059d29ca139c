//! Token authentication bound to the TLS session, with no offline guessing.
//!
//! Every node has a throw-away self-signed certificate (TLS gives encryption and a session
//! secret). On the connection's first bidirectional stream the two ends run SPAKE2 (a
//! password-authenticated key exchange, RustCrypto's `spake2`, symmetric mode) with the
//! token as the password, then each proves it derived the same key with a confirmation MAC
//! bound to the TLS session:
//!
//! ```text
//! client -> server   hello  (version, node, run, lane, SPAKE2 message X)
//! server -> client   hello  (..., SPAKE2 message Y, confirm_s)
//! client -> server   confirm_c            (only if confirm_s verified)
//! server -> client   end of stream        (only if confirm_c verified: accepted)
//! confirm_r = HMAC-SHA256(K, "meshd confirm v1" || r || exporter || client node || server node
//!                         || client run || server run || X || Y)
//! ```
//!
//! `K` is the SPAKE2 key, `exporter` 32 bytes of TLS keying material (RFC 5705) unique to the
//! connection. What an eavesdropper, a squatter on a peer's address or a client without the
//! token sees (X, Y, a confirmation) lets it test ONE guess of the token per connection,
//! online, against a live node; nothing it records can be tested offline (that would need
//! the discrete log). A man in the middle holds two TLS sessions with two exporters and
//! cannot make either confirmation verify; the role byte stops a reflected one. The token
//! never travels and nothing derived from it is published (the run id is not). See
//! docs/PROTOCOL.md for why a PAKE instead of a slow KDF.

use ring::{digest, hmac};
use spake2::{Ed25519Group, Identity, Password, Spake2};

/// Label for the TLS exporter.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-meshd-auth-v2";

/// SPAKE2's identity string (both ends, symmetric mode): the protocol and its version.
const PAKE_IDENTITY: &[u8] = b"meshd token pake v1";

/// Length of a SPAKE2 message (a side byte and an Ed25519 point).
pub const PAKE_MESSAGE_LEN: usize = 33;

/// Which end of the connection computes the confirmation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

/// The cluster secret, kept only in derived form (never printed).
#[derive(Clone)]
pub struct Token {
    password: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<redacted>)")
    }
}

impl Token {
    /// Takes the user's secret. Leading/trailing whitespace (a token file's newline) is
    /// ignored.
    pub fn new(secret: &str) -> Self {
        let mut ctx = digest::Context::new(&digest::SHA256);
        ctx.update(b"meshd token v2");
        ctx.update(secret.trim().as_bytes());
        let mut password = [0u8; 32];
        password.copy_from_slice(ctx.finish().as_ref());
        Token { password }
    }

    /// Starts the key exchange for one connection (fresh randomness each time).
    pub fn start(&self) -> Pake {
        let (state, message) = Spake2::<Ed25519Group>::start_symmetric(
            &Password::new(self.password),
            &Identity::new(PAKE_IDENTITY),
        );
        Pake { state, message }
    }
}

/// One connection's side of the key exchange.
pub struct Pake {
    state: Spake2<Ed25519Group>,
    message: Vec<u8>,
}

impl std::fmt::Debug for Pake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pake(<secret>)")
    }
}

impl Pake {
    /// The message to send the other end.
    pub fn message(&self) -> &[u8] {
        &self.message
    }

    /// The session key from the other end's message, or `None` when it is malformed. A
    /// wrong token does not fail here: it yields another key, and the confirmation fails.
    pub fn finish(self, theirs: &[u8]) -> Option<SessionKey> {
        let k = self.state.finish(theirs).ok()?;
        Some(SessionKey { key: hmac::Key::new(hmac::HMAC_SHA256, &k) })
    }
}

/// What a confirmation is bound to: the TLS session, both nodes, both runs, both messages.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// TLS exporter of this connection.
    pub exporter: &'a [u8; 32],
    /// The connecting node's id.
    pub client: &'a [u8; 16],
    /// The accepting node's id.
    pub server: &'a [u8; 16],
    /// The connecting node's run hash.
    pub client_run: u64,
    /// The accepting node's run hash.
    pub server_run: u64,
    /// The connecting node's SPAKE2 message.
    pub client_msg: &'a [u8],
    /// The accepting node's SPAKE2 message.
    pub server_msg: &'a [u8],
}

impl Transcript<'_> {
    fn bytes(&self, role: Role) -> Vec<u8> {
        let mut m = Vec::with_capacity(128 + self.client_msg.len() + self.server_msg.len());
        m.extend_from_slice(b"meshd confirm v1");
        m.push(match role {
            Role::Client => b'c',
            Role::Server => b's',
        });
        m.extend_from_slice(self.exporter);
        m.extend_from_slice(self.client);
        m.extend_from_slice(self.server);
        m.extend_from_slice(&self.client_run.to_be_bytes());
        m.extend_from_slice(&self.server_run.to_be_bytes());
        for part in [self.client_msg, self.server_msg] {
            m.extend_from_slice(&(part.len() as u16).to_be_bytes());
            m.extend_from_slice(part);
        }
        m
    }
}

/// The key both ends derived (if they hold the same token).
pub struct SessionKey {
    key: hmac::Key,
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionKey(<secret>)")
    }
}

impl SessionKey {
    /// The confirmation `role` sends.
    pub fn confirm(&self, role: Role, t: &Transcript<'_>) -> [u8; 32] {
        let tag = hmac::sign(&self.key, &t.bytes(role));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Constant-time check of the other end's confirmation.
    pub fn verify(&self, role: Role, t: &Transcript<'_>, mac: &[u8]) -> bool {
        hmac::verify(&self.key, &t.bytes(role), mac).is_ok()
    }
}

/// What to do about a token mismatch, said on both ends.
const SAME_TOKEN: &str = "give every node the same --token, MESHD_TOKEN or --token-file";

/// Why one end refused the other's hello.
///
/// The QUIC close reason carries [`Refusal::wire`], a short keyword. Each end then words it
/// from its own side: the refusing node with [`Refusal::here`] ("it has no token; this node
/// has one"), the refused node, reading the close reason, with [`Refusal::there`] ("this
/// node has no token; 198.19.0.7 has one"). The reason never reads backwards on either end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Both ends hold a token, not the same one.
    DifferentToken,
    /// The refused node has no token; the refusing node has one.
    NoToken,
    /// The refused node holds a token; the refusing node has none.
    UnexpectedToken,
    /// The two ends have different run ids.
    OtherRun,
    /// The refused node speaks another protocol version; this is the refusing node's.
    Version(u16),
    /// The hello carried the refusing node's own id.
    Itself,
    /// Anything else, in the refusing node's words (sent as is).
    Other(String),
}

impl Refusal {
    /// The close reason on the wire.
    pub fn wire(&self) -> String {
        match self {
            Refusal::DifferentToken => "different token".into(),
            Refusal::NoToken => "no token".into(),
            Refusal::UnexpectedToken => "unexpected token".into(),
            Refusal::OtherRun => "another run".into(),
            Refusal::Version(v) => format!("meshd protocol v{v}"),
            Refusal::Itself => "itself".into(),
            Refusal::Other(s) => s.clone(),
        }
    }

    /// Reads a close reason (any text that is not a keyword is kept as [`Refusal::Other`]).
    pub fn parse(wire: &str) -> Refusal {
        match wire {
            "different token" => Refusal::DifferentToken,
            "no token" => Refusal::NoToken,
            "unexpected token" => Refusal::UnexpectedToken,
            "another run" => Refusal::OtherRun,
            "itself" => Refusal::Itself,
            w => match w.strip_prefix("meshd protocol v").and_then(|v| v.parse().ok()) {
                Some(v) => Refusal::Version(v),
                None => Refusal::Other(w.to_string()),
            },
        }
    }

    /// The reason as the refusing node logs it ("peer X failed authentication: ..."), where
    /// "it" is the peer. `peer_version` is the version the peer announced.
    pub fn here(&self, peer_version: u16) -> String {
        let own_version = match self {
            Refusal::Version(v) => *v,
            _ => 0,
        };
        let itself = "it is this node itself (same node id)";
        self.words("it", ("it", "this node"), (peer_version, own_version), itself)
    }

    /// The reason as the refused node logs it ("peer X refused this node: failed
    /// authentication: ..."), naming the refusing `peer`; `own_version` is this node's.
    pub fn there(&self, peer: std::net::IpAddr, own_version: u16) -> String {
        let peer_version = match self {
            Refusal::Version(v) => *v,
            _ => 0,
        };
        let peer = peer.to_string();
        let itself = format!("{peer} has this node's own id");
        self.words(&peer, ("this node", &peer), (peer_version, own_version), &itself)
    }

    /// The reason in the words of one end: `far` names the other end, `refused` and
    /// `refusing` the two ends, `far_version` and `own_version` what each speaks; `itself`
    /// is the words for [`Refusal::Itself`].
    fn words(
        &self,
        far: &str,
        (refused, refusing): (&str, &str),
        (far_version, own_version): (u16, u16),
        itself: &str,
    ) -> String {
        match self {
            Refusal::DifferentToken => {
                format!("different token: {far} holds another token than this node ({SAME_TOKEN})")
            }
            Refusal::NoToken => format!("{refused} has no token; {refusing} has one ({SAME_TOKEN})"),
            Refusal::UnexpectedToken => {
                format!("{refused} holds a token; {refusing} has none ({SAME_TOKEN})")
            }
            Refusal::OtherRun => format!("{far} belongs to another job: {}", other_run_hint()),
            Refusal::Version(_) => {
                format!("{far} speaks meshd protocol v{far_version}, this node v{own_version}")
            }
            Refusal::Itself => itself.into(),
            Refusal::Other(s) => s.clone(),
        }
    }
}

fn other_run_hint() -> &'static str {
    "its run id differs from this node's (the run id is --run-id, else derived from SLURM_JOB_ID \
     only); another job with the same token uses these nodes: give each job its own --run-id"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The session of the tests' two nodes (ids 1 and 2, run 9) with `exporter` and the
    /// SPAKE2 messages `ma` (client) and `mb` (server).
    fn transcript<'a>(exporter: &'a [u8; 32], ma: &'a [u8], mb: &'a [u8]) -> Transcript<'a> {
        Transcript {
            exporter,
            client: &[1; 16],
            server: &[2; 16],
            client_run: 9,
            server_run: 9,
            client_msg: ma,
            server_msg: mb,
        }
    }

    /// Runs the exchange between a client holding `a` and a server holding `b`, each end
    /// with its own TLS exporter; (client accepts the server, server accepts the client).
    fn exchange(a: &Token, b: &Token, ex_a: [u8; 32], ex_b: [u8; 32]) -> (bool, bool) {
        let (pa, pb) = (a.start(), b.start());
        let (ma, mb) = (pa.message().to_vec(), pb.message().to_vec());
        assert_eq!(ma.len(), PAKE_MESSAGE_LEN);
        let (ka, kb) = (pa.finish(&mb).expect("a"), pb.finish(&ma).expect("b"));
        let (ta, tb) = (transcript(&ex_a, &ma, &mb), transcript(&ex_b, &ma, &mb));
        let s = kb.confirm(Role::Server, &tb);
        let c = ka.confirm(Role::Client, &ta);
        (ka.verify(Role::Server, &ta, &s), kb.verify(Role::Client, &tb, &c))
    }

    #[test]
    fn confirmations_verify_only_with_the_same_token_and_session() {
        let a = Token::new("s3cret\n");
        let same = Token::new("s3cret");
        let other = Token::new("other");
        assert_eq!(exchange(&a, &same, [5; 32], [5; 32]), (true, true));
        assert_eq!(exchange(&a, &other, [5; 32], [5; 32]), (false, false), "another token");
        assert_eq!(exchange(&a, &same, [5; 32], [6; 32]), (false, false), "a man in the middle");
        assert_eq!(format!("{a:?}"), "Token(<redacted>)");
        // A reflected confirmation (the server's sent back as the client's) does not verify.
        let (pa, pb) = (a.start(), same.start());
        let (ma, mb) = (pa.message().to_vec(), pb.message().to_vec());
        let (ka, kb) = (pa.finish(&mb).expect("a"), pb.finish(&ma).expect("b"));
        let t = transcript(&[5; 32], &ma, &mb);
        let s = kb.confirm(Role::Server, &t);
        assert!(ka.verify(Role::Server, &t, &s));
        assert!(!kb.verify(Role::Client, &t, &s), "reflection");
        // Other node, other run: no.
        let other_node = Transcript { client: &[3; 16], ..t };
        assert!(!ka.verify(Role::Server, &other_node, &s));
        let other_run = Transcript { server_run: 10, ..t };
        assert!(!ka.verify(Role::Server, &other_run, &s));
        // Malformed messages end the exchange.
        assert!(a.start().finish(&[0u8; 3]).is_none());
    }

    /// Two starts with the same token send different messages: nothing derived from the
    /// token alone is on the wire.
    #[test]
    fn messages_are_fresh_each_connection() {
        let t = Token::new("s3cret");
        assert_ne!(t.start().message(), t.start().message());
    }

    #[test]
    fn refusals_read_right_on_both_ends() {
        let peer: std::net::IpAddr = [198, 19, 0, 7].into();
        // The refused node has no token: it says so about itself, not about the refuser.
        let r = Refusal::parse(&Refusal::NoToken.wire());
        assert_eq!(r, Refusal::NoToken);
        assert!(
            r.there(peer, 3).starts_with("this node has no token; 198.19.0.7 has one"),
            "{}",
            r.there(peer, 3)
        );
        assert!(r.here(3).starts_with("it has no token; this node has one"), "{}", r.here(3));
        let r = Refusal::parse(&Refusal::UnexpectedToken.wire());
        assert!(r.there(peer, 3).starts_with("this node holds a token; 198.19.0.7 has none"));
        assert!(r.here(3).starts_with("it holds a token; this node has none"));
        // "different token" stays the close reason (tools and tests read it).
        assert_eq!(Refusal::DifferentToken.wire(), "different token");
        assert!(
            Refusal::DifferentToken.there(peer, 3).starts_with("different token: 198.19.0.7 holds another")
        );
        let v = Refusal::parse(&Refusal::Version(3).wire());
        assert_eq!(v, Refusal::Version(3));
        assert_eq!(v.there(peer, 2), "198.19.0.7 speaks meshd protocol v3, this node v2");
        assert_eq!(v.here(2), "it speaks meshd protocol v2, this node v3");
        // Unknown text (an older meshd's sentence) is printed as it came.
        assert_eq!(Refusal::parse("lane 20 is not allowed").there(peer, 3), "lane 20 is not allowed");
    }

    #[test]
    fn another_run_names_what_separates_runs() {
        let peer: std::net::IpAddr = [198, 19, 0, 7].into();
        for s in [Refusal::OtherRun.here(3), Refusal::OtherRun.there(peer, 3)] {
            assert!(s.contains("--run-id, else derived from SLURM_JOB_ID"), "{s}");
            assert!(
                s.contains(
                    "another job with the same token uses these nodes: give each job its own --run-id"
                ),
                "{s}"
            );
            assert!(!s.contains("command or peers"), "the command and peers do not separate runs: {s}");
        }
    }
}
