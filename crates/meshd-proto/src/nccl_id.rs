//! `ncclUniqueId`: 128 opaque bytes, hex transport, root address decoding.
//!
//! Plain byte layout code, here rather than in `meshd-nccl`, so that the parts of meshd
//! that only carry an id and check its root (the preflight) never link CUDA or NCCL.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// `AF_INET` on Linux.
const AF_INET: u16 = 2;
/// `AF_INET6` on Linux.
const AF_INET6: u16 = 10;

/// A unique id in hex that did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid NCCL unique id: {0} (expected 256 hex characters)")]
pub struct BadHex(String);

/// An `ncclUniqueId`: 128 bytes, opaque (it contains NULs). Layout (NCCL bootstrap.h):
/// u64 magic, then the root's `sockaddr` (bytes 8..36), from NCCL 2.29 nRanks at 36..40;
/// the rest is unused.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl UniqueId {
    /// 256 lowercase hex characters (the form of `MESHD_NCCL_UNIQUE_ID`).
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(256);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        s
    }

    /// Parses 256 hex characters (either case; surrounding whitespace is ignored).
    pub fn from_hex(s: &str) -> Result<Self, BadHex> {
        let s = s.trim();
        if s.len() != 256 {
            return Err(BadHex(format!("{} characters", s.len())));
        }
        let mut out = [0u8; 128];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]);
            let lo = hex_val(pair[1]);
            match (hi, lo) {
                (Some(hi), Some(lo)) => out[i] = (hi << 4) | lo,
                _ => {
                    return Err(BadHex(format!(
                        "non-hex character at offset {}",
                        if hi.is_none() { 2 * i } else { 2 * i + 1 }
                    )));
                }
            }
        }
        Ok(Self(out))
    }

    /// The bootstrap root's address decoded from bytes 8..36 (u16 family in host order,
    /// port in network order, then the IPv4 or IPv6 address); `None` for another family.
    pub fn root(&self) -> Option<SocketAddr> {
        let b = &self.0;
        let family = u16::from_ne_bytes([b[8], b[9]]);
        let port = u16::from_be_bytes([b[10], b[11]]);
        match family {
            AF_INET => {
                let ip = Ipv4Addr::new(b[12], b[13], b[14], b[15]);
                Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
            }
            AF_INET6 => {
                let flowinfo = u32::from_be_bytes([b[12], b[13], b[14], b[15]]);
                let mut a = [0u8; 16];
                a.copy_from_slice(&b[16..32]);
                let scope = u32::from_ne_bytes([b[32], b[33], b[34], b[35]]);
                Some(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(a), port, flowinfo, scope)))
            }
            _ => None,
        }
    }

    /// The magic (bytes 0..8, host order): random per id, checked by the root.
    pub fn magic(&self) -> u64 {
        let mut m = [0u8; 8];
        m.copy_from_slice(&self.0[..8]);
        u64::from_ne_bytes(m)
    }

    /// Whether both ids name the same root: bytes 0..40 (magic, address, nRanks) are equal.
    /// The rest may be garbage (NCCL < 2.23).
    pub fn same_as(&self, other: &UniqueId) -> bool {
        self.0[..40] == other.0[..40]
    }

    /// Builds an id from a magic and a root address (as NCCL lays it out); for tests and
    /// diagnostics, not a substitute for `ncclGetUniqueId` (no root is started).
    pub fn from_parts(magic: u64, root: SocketAddr) -> Self {
        let mut b = [0u8; 128];
        b[..8].copy_from_slice(&magic.to_ne_bytes());
        match root {
            SocketAddr::V4(a) => {
                b[8..10].copy_from_slice(&AF_INET.to_ne_bytes());
                b[10..12].copy_from_slice(&a.port().to_be_bytes());
                b[12..16].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[8..10].copy_from_slice(&AF_INET6.to_ne_bytes());
                b[10..12].copy_from_slice(&a.port().to_be_bytes());
                b[12..16].copy_from_slice(&a.flowinfo().to_be_bytes());
                b[16..32].copy_from_slice(&a.ip().octets());
                b[32..36].copy_from_slice(&a.scope_id().to_ne_bytes());
            }
        }
        Self(b)
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        f.debug_struct("UniqueId").field("root", &self.root()).field("head", &&hex[..80]).finish()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::str::FromStr for UniqueId {
    type Err = BadHex;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_hex(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(37).wrapping_add(1);
        }
        b[5] = 0;
        let id = UniqueId(b);
        let h = id.to_hex();
        assert_eq!(h.len(), 256);
        assert!(h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        let back = UniqueId::from_hex(&h).expect("parses");
        assert_eq!(back, id);
        let upper = UniqueId::from_hex(&format!("  {}\n", h.to_uppercase())).expect("parses");
        assert_eq!(upper, id);
        assert_eq!(h.parse::<UniqueId>().expect("parses"), id);
    }

    #[test]
    fn hex_errors() {
        assert_eq!(UniqueId::from_hex("abc"), Err(BadHex("3 characters".into())));
        let mut bad = "0".repeat(256);
        bad.replace_range(7..8, "g");
        let e = UniqueId::from_hex(&bad).expect_err("must fail");
        assert!(e.to_string().contains("offset 7"), "{e}");
        // Multi-byte UTF-8 must not panic.
        let s = "é".repeat(128);
        assert!(UniqueId::from_hex(&s).is_err());
    }

    #[test]
    fn root_ipv4_handcrafted() {
        // Exactly as NCCL writes it: family host-endian, port and address network order.
        let mut b = [0xAAu8; 128];
        b[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_ne_bytes());
        b[8..10].copy_from_slice(&2u16.to_ne_bytes());
        b[10..12].copy_from_slice(&41234u16.to_be_bytes());
        b[12..16].copy_from_slice(&[198, 19, 0, 7]);
        let id = UniqueId(b);
        assert_eq!(id.root(), Some("198.19.0.7:41234".parse().expect("addr")));
        assert_eq!(id.magic(), 0x1122_3344_5566_7788);
        let built = UniqueId::from_parts(0x1122_3344_5566_7788, "198.19.0.7:41234".parse().expect("addr"));
        assert_eq!(built.0[..16], id.0[..16]);
    }

    #[test]
    fn root_ipv6_handcrafted() {
        let mut b = [0u8; 128];
        b[8..10].copy_from_slice(&10u16.to_ne_bytes());
        b[10..12].copy_from_slice(&[0xA1, 0x12]); // 41234
        b[12..16].copy_from_slice(&[0, 0, 0, 0]);
        b[16..32].copy_from_slice(&[0xfd, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x07]);
        b[32..36].copy_from_slice(&3u32.to_ne_bytes());
        let id = UniqueId(b);
        match id.root() {
            Some(SocketAddr::V6(a)) => {
                assert_eq!(*a.ip(), "fd00::7".parse::<Ipv6Addr>().expect("ip"));
                assert_eq!(a.port(), 41234);
                assert_eq!(a.scope_id(), 3);
            }
            other => panic!("expected v6, got {other:?}"),
        }
    }

    #[test]
    fn from_parts_round_trip_and_unknown_family() {
        for a in ["198.19.0.7:41234", "[fe80::1%2]:29500", "[::1]:1"] {
            let addr: SocketAddr = a.parse().expect("addr");
            let id = UniqueId::from_parts(42, addr);
            assert_eq!(id.root(), Some(addr), "{a}");
            assert_eq!(id.magic(), 42);
        }
        assert_eq!(UniqueId([0u8; 128]).root(), None);
    }

    #[test]
    fn same_as_compares_first_40_bytes() {
        let a = UniqueId::from_parts(7, "10.0.0.1:5000".parse().expect("addr"));
        let mut b = a;
        b.0[100] = 0xff;
        assert!(a.same_as(&b));
        assert_ne!(a, b);
        b.0[39] = 1;
        assert!(!a.same_as(&b));
        let c = UniqueId::from_parts(8, "10.0.0.1:5000".parse().expect("addr"));
        assert!(!a.same_as(&c));
        let dbg = format!("{a:?}");
        assert!(dbg.contains("10.0.0.1:5000"), "{dbg}");
    }
}
