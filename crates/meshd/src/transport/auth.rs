//! Token authentication bound to the TLS session.
//!
//! Every node has a throw-away self-signed certificate (TLS gives encryption and a session
//! secret), and proves it holds the cluster token by sending
//! `HMAC-SHA256(K, exporter || role || node || run)`, where `K = SHA-256("meshd token v1" ||
//! token)` and `exporter` is 32 bytes of TLS keying material (RFC 5705) unique to this
//! connection. The token never travels; a recorded MAC is useless on any other connection
//! (other exporter); a man in the middle holds two different sessions and cannot forge
//! either MAC; the role byte stops a reflected MAC. See docs/PROTOCOL.md for why this was
//! chosen over a token-derived CA.

use ring::{digest, hmac};

/// Label for the TLS exporter.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-meshd-auth-v1";

/// Which end of the connection computes the MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

/// The cluster secret, kept only as a derived HMAC key (never printed).
#[derive(Clone)]
pub struct Token {
    key: hmac::Key,
    /// Short public fingerprint (for run ids), not the token.
    fingerprint: u64,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<redacted>)")
    }
}

impl Token {
    /// Derives the key from the user's secret. Leading/trailing whitespace (a token file's
    /// newline) is ignored.
    pub fn new(secret: &str) -> Self {
        let secret = secret.trim();
        let mut ctx = digest::Context::new(&digest::SHA256);
        ctx.update(b"meshd token v1");
        ctx.update(secret.as_bytes());
        let k = ctx.finish();
        let fp = digest::digest(&digest::SHA256, k.as_ref());
        let mut b = [0u8; 8];
        b.copy_from_slice(&fp.as_ref()[..8]);
        Token { key: hmac::Key::new(hmac::HMAC_SHA256, k.as_ref()), fingerprint: u64::from_be_bytes(b) }
    }

    /// A value derived twice from the token (safe to mix into a run id).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The MAC one end sends.
    pub fn mac(&self, exporter: &[u8; 32], role: Role, node: &[u8; 16], run_hash: u64) -> [u8; 32] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(exporter);
        ctx.update(match role {
            Role::Client => b"c",
            Role::Server => b"s",
        });
        ctx.update(node);
        ctx.update(&run_hash.to_be_bytes());
        let tag = ctx.sign();
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Constant-time check of a peer's MAC.
    pub fn verify(
        &self,
        exporter: &[u8; 32],
        role: Role,
        node: &[u8; 16],
        run_hash: u64,
        mac: &[u8; 32],
    ) -> bool {
        let mut msg = Vec::with_capacity(32 + 1 + 16 + 8);
        msg.extend_from_slice(exporter);
        msg.push(match role {
            Role::Client => b'c',
            Role::Server => b's',
        });
        msg.extend_from_slice(node);
        msg.extend_from_slice(&run_hash.to_be_bytes());
        hmac::verify(&self.key, &msg, mac).is_ok()
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
        match self {
            Refusal::DifferentToken => {
                format!("different token: it holds another token than this node ({SAME_TOKEN})")
            }
            Refusal::NoToken => format!("it has no token; this node has one ({SAME_TOKEN})"),
            Refusal::UnexpectedToken => format!("it holds a token; this node has none ({SAME_TOKEN})"),
            Refusal::OtherRun => format!("it belongs to another job: {}", other_run_hint()),
            Refusal::Version(v) => format!("it speaks meshd protocol v{peer_version}, this node v{v}"),
            Refusal::Itself => "it is this node itself (same node id)".into(),
            Refusal::Other(s) => s.clone(),
        }
    }

    /// The reason as the refused node logs it ("peer X refused this node: failed
    /// authentication: ..."), naming the refusing `peer`; `own_version` is this node's.
    pub fn there(&self, peer: std::net::IpAddr, own_version: u16) -> String {
        match self {
            Refusal::DifferentToken => {
                format!("different token: {peer} holds another token than this node ({SAME_TOKEN})")
            }
            Refusal::NoToken => format!("this node has no token; {peer} has one ({SAME_TOKEN})"),
            Refusal::UnexpectedToken => format!("this node holds a token; {peer} has none ({SAME_TOKEN})"),
            Refusal::OtherRun => format!("{peer} belongs to another job: {}", other_run_hint()),
            Refusal::Version(v) => format!("{peer} speaks meshd protocol v{v}, this node v{own_version}"),
            Refusal::Itself => format!("{peer} has this node's own id"),
            Refusal::Other(s) => s.clone(),
        }
    }
}

/// What separates runs, and what to do when two jobs meet.
fn other_run_hint() -> &'static str {
    "its run id differs from this node's (the run id is --run-id, else derived from the token and \
     SLURM_JOB_ID only); another job with the same token uses these nodes: give each job its own --run-id"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_verifies_only_with_same_token_role_and_session() {
        let a = Token::new("s3cret\n");
        let same = Token::new("s3cret");
        let other = Token::new("other");
        let ex = [5u8; 32];
        let node = [1u8; 16];
        let mac = a.mac(&ex, Role::Client, &node, 9);
        assert!(same.verify(&ex, Role::Client, &node, 9, &mac));
        assert!(!other.verify(&ex, Role::Client, &node, 9, &mac));
        assert!(!a.verify(&ex, Role::Server, &node, 9, &mac), "reflection");
        assert!(!a.verify(&[6u8; 32], Role::Client, &node, 9, &mac), "other session");
        assert!(!a.verify(&ex, Role::Client, &[2u8; 16], 9, &mac), "other node");
        assert!(!a.verify(&ex, Role::Client, &node, 10, &mac), "other run");
        assert_eq!(format!("{a:?}"), "Token(<redacted>)");
        assert_eq!(a.fingerprint(), same.fingerprint());
        assert_ne!(a.fingerprint(), other.fingerprint());
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
            assert!(s.contains("--run-id, else derived from the token and SLURM_JOB_ID"), "{s}");
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
