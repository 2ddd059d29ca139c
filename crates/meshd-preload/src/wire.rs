//! The wire of the tunnel socket (meshd's `tunnel` module speaks the other end).
//!
//! Only `std` here: meshd compiles this same file as its `tunnel::wire` (this crate cannot
//! be a dependency of meshd: it exports `connect`).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// First bytes of a request on the tunnel socket.
pub const MAGIC: [u8; 2] = *b"MT";
/// Version of the request (the one meshd forwards to the far end).
pub const VERSION: u8 = 1;
/// The version byte of a request followed by [`PAD`] bytes, which the near end reads only
/// once it has written the status: until then the rank's socket (its send buffer at the
/// minimum) polls not writable, as a TCP socket whose connect is in progress.
pub const VERSION_PADDED: u8 = 2;
/// The padding after a [`VERSION_PADDED`] request. A Unix stream socket is writable while
/// the bytes its peer has not read take at most a quarter of its send buffer; at the
/// minimum buffer (4608 bytes) 2 KiB unread keep it not writable.
pub const PAD: usize = 2048;
/// Request length: magic, version, family (4 or 6), port (u16 BE), address (16 bytes,
/// IPv4 as IPv4-mapped IPv6).
pub const REQUEST_LEN: usize = 22;

/// The one status byte meshd answers.
pub mod status {
    /// Connected: the stream follows.
    pub const OK: u8 = 0;
    /// The destination refused the connection (nothing listens there).
    pub const REFUSED: u8 = 1;
    /// The destination node cannot be reached (not a roster node, its meshd is gone).
    pub const UNREACHABLE: u8 = 2;
    /// No answer in time.
    pub const TIMED_OUT: u8 = 3;
    /// Any other failure (reset, limits).
    pub const FAILED: u8 = 4;
}

/// The request for `dest`.
pub fn encode_request(dest: SocketAddr) -> [u8; REQUEST_LEN] {
    let mut r = [0u8; REQUEST_LEN];
    r[..2].copy_from_slice(&MAGIC);
    r[2] = VERSION;
    let (family, ip) = match dest.ip() {
        IpAddr::V4(v4) => (4, v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => (6, v6),
    };
    r[3] = family;
    r[4..6].copy_from_slice(&dest.port().to_be_bytes());
    r[6..22].copy_from_slice(&ip.octets());
    r
}

/// What the library sends on the tunnel socket: the request for `dest` marked
/// [`VERSION_PADDED`], then [`PAD`] zero bytes.
pub fn encode_padded_request(dest: SocketAddr) -> Vec<u8> {
    let mut r = vec![0u8; REQUEST_LEN + PAD];
    r[..REQUEST_LEN].copy_from_slice(&encode_request(dest));
    r[2] = VERSION_PADDED;
    r
}

/// The destination of a request, or `None` when it is not one.
pub fn decode_request(r: &[u8; REQUEST_LEN]) -> Option<SocketAddr> {
    if r[..2] != MAGIC || r[2] != VERSION {
        return None;
    }
    let port = u16::from_be_bytes([r[4], r[5]]);
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&r[6..22]);
    let ip = Ipv6Addr::from(ip);
    let ip = match r[3] {
        4 => IpAddr::V4(ip.to_ipv4_mapped()?),
        6 => IpAddr::V6(ip),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// `MESHD_TUNNEL_PEERS`: comma-separated addresses (IPv4-mapped IPv6 reads as IPv4);
/// what does not parse is skipped.
pub fn parse_peers(s: &str) -> Vec<IpAddr> {
    s.split(',').filter_map(|p| p.trim().parse::<IpAddr>().ok()).map(|ip| ip.to_canonical()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for d in ["198.19.0.7:29500", "[fd00::7]:40000", "10.0.0.1:1"] {
            let d: SocketAddr = d.parse().expect("addr");
            assert_eq!(decode_request(&encode_request(d)), Some(d));
        }
        let mut bad = encode_request("10.0.0.1:1".parse().expect("addr"));
        bad[2] = 9;
        assert_eq!(decode_request(&bad), None);
        let mut bad = encode_request("10.0.0.1:1".parse().expect("addr"));
        bad[3] = 5;
        assert_eq!(decode_request(&bad), None);
        // Family 4 with an address that is not IPv4-mapped.
        let mut bad = encode_request("[fd00::7]:1".parse().expect("addr"));
        bad[3] = 4;
        assert_eq!(decode_request(&bad), None);
    }

    #[test]
    fn a_padded_request_is_the_request_marked_then_zeros() {
        let d: SocketAddr = "198.19.0.7:29500".parse().expect("addr");
        let p = encode_padded_request(d);
        assert_eq!(p.len(), REQUEST_LEN + PAD);
        assert_eq!(p[2], VERSION_PADDED);
        // Not a version-1 request as it stands (the near end rewrites the version byte).
        let mut head: [u8; REQUEST_LEN] = p[..REQUEST_LEN].try_into().expect("head");
        assert_eq!(decode_request(&head), None);
        head[2] = VERSION;
        assert_eq!(decode_request(&head), Some(d));
        assert!(p[REQUEST_LEN..].iter().all(|b| *b == 0));
    }

    #[test]
    fn peers_parse_and_skip_garbage() {
        assert_eq!(
            parse_peers("198.19.0.7, ::ffff:198.19.0.19,nonsense,,fd00::1"),
            vec![
                "198.19.0.7".parse::<IpAddr>().expect("ip"),
                "198.19.0.19".parse().expect("ip"),
                "fd00::1".parse().expect("ip")
            ]
        );
    }
}
