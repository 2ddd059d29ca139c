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
}
