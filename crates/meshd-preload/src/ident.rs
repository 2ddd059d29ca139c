//! A tunnelled socket says what it is by itself: before it connects to meshd, the Unix
//! socket that takes the place of the application's TCP socket is bound to an abstract
//! name that encodes the TCP socket it stands for (its family, the destination as the
//! application gave it, the address it was bound to, its TCP/IP options at the swap). Any
//! fd of it (`dup`, `socket.fromfd`, an fd inherited by a child, even after `exec`, which
//! loads this library again with empty memory) is recognised with one `getsockname`, and
//! the answers for `getpeername`, `getsockname` and `SO_DOMAIN` come from that name alone.

use std::ffi::c_int;

use crate::sys::{AF_INET, AF_INET6, AF_UNIX, sockaddr_un, socklen_t};

/// First bytes of the abstract name (after its NUL).
const MAGIC: &[u8; 4] = b"mshd";
const VERSION: u8 = 1;
/// `sun_path` bytes (the leading NUL included).
const PATH_MAX: usize = 108;

/// An IPv4 or IPv6 socket address, as a `sockaddr_in`/`sockaddr_in6` carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addr {
    pub v6: bool,
    /// Host order.
    pub port: u16,
    /// IPv4 in the first 4 bytes.
    pub ip: [u8; 16],
    pub flowinfo: u32,
    pub scope: u32,
}

impl Addr {
    /// From a `sockaddr_in`/`sockaddr_in6` (`None` for another family or a short buffer).
    pub fn from_sockaddr(b: &[u8]) -> Option<Addr> {
        if b.len() < 2 {
            return None;
        }
        let family = u16::from_ne_bytes([b[0], b[1]]) as c_int;
        let port = |b: &[u8]| u16::from_be_bytes([b[2], b[3]]);
        match family {
            AF_INET if b.len() >= 8 => {
                let mut ip = [0u8; 16];
                ip[..4].copy_from_slice(&b[4..8]);
                Some(Addr { v6: false, port: port(b), ip, flowinfo: 0, scope: 0 })
            }
            AF_INET6 if b.len() >= 28 => {
                let mut ip = [0u8; 16];
                ip.copy_from_slice(&b[8..24]);
                let flowinfo = u32::from_ne_bytes([b[4], b[5], b[6], b[7]]);
                let scope = u32::from_ne_bytes([b[24], b[25], b[26], b[27]]);
                Some(Addr { v6: true, port: port(b), ip, flowinfo, scope })
            }
            _ => None,
        }
    }

    /// As a `sockaddr_in`/`sockaddr_in6`: the bytes and how many of them.
    pub fn to_sockaddr(self) -> ([u8; 28], usize) {
        let mut b = [0u8; 28];
        b[2..4].copy_from_slice(&self.port.to_be_bytes());
        if self.v6 {
            b[..2].copy_from_slice(&(AF_INET6 as u16).to_ne_bytes());
            b[4..8].copy_from_slice(&self.flowinfo.to_ne_bytes());
            b[8..24].copy_from_slice(&self.ip);
            b[24..28].copy_from_slice(&self.scope.to_ne_bytes());
            (b, 28)
        } else {
            b[..2].copy_from_slice(&(AF_INET as u16).to_ne_bytes());
            b[4..8].copy_from_slice(&self.ip[..4]);
            (b, 16)
        }
    }

    /// Whether this is the unspecified address with port 0 (an unbound socket's name).
    pub fn is_unbound(&self) -> bool {
        self.port == 0 && self.ip == [0u8; 16]
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(if self.v6 { 6 } else { 4 });
        out.extend_from_slice(&self.port.to_be_bytes());
        if self.v6 {
            out.extend_from_slice(&self.ip);
            out.extend_from_slice(&self.flowinfo.to_le_bytes());
            out.extend_from_slice(&self.scope.to_le_bytes());
        } else {
            out.extend_from_slice(&self.ip[..4]);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Option<Option<Addr>> {
        let family = r.byte()?;
        if family == 0 {
            return Some(None);
        }
        let port = u16::from_be_bytes(r.take::<2>()?);
        let mut ip = [0u8; 16];
        match family {
            4 => {
                ip[..4].copy_from_slice(&r.take::<4>()?);
                Some(Some(Addr { v6: false, port, ip, flowinfo: 0, scope: 0 }))
            }
            6 => {
                ip = r.take::<16>()?;
                let flowinfo = u32::from_le_bytes(r.take::<4>()?);
                let scope = u32::from_le_bytes(r.take::<4>()?);
                Some(Some(Addr { v6: true, port, ip, flowinfo, scope }))
            }
            _ => None,
        }
    }
}

/// What a tunnelled socket stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The TCP socket's family (`AF_INET` or `AF_INET6`).
    pub domain: c_int,
    /// The destination, as the application passed it to `connect`.
    pub peer: Addr,
    /// The address the application bound the socket to before `connect`, if it did.
    pub local: Option<Addr>,
    /// The values of [`crate::opts::EMULATED`] at the swap, in that order; a name too short
    /// for all of them (see [`encode`]) leaves the rest 0.
    pub opts: Vec<i32>,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        if self.0.len() < N {
            return None;
        }
        let (a, rest) = self.0.split_at(N);
        self.0 = rest;
        a.try_into().ok()
    }
    fn varint(&mut self) -> Option<u32> {
        let mut v: u32 = 0;
        for i in 0..5 {
            let b = self.byte()?;
            v |= u32::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }
}

fn varint(mut v: u32, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// The abstract `sockaddr_un` for `id` (and its length), `unique` telling sockets apart:
/// the options that do not fit in the name's 108 bytes are left out (they read as 0 in
/// a process that learns them from the name alone).
pub fn encode(id: &Identity, unique: u64) -> (sockaddr_un, socklen_t) {
    let mut n = vec![0u8];
    n.extend_from_slice(MAGIC);
    n.push(VERSION);
    n.push(if id.domain == AF_INET6 { 6 } else { 4 });
    n.extend_from_slice(&unique.to_le_bytes());
    id.peer.encode(&mut n);
    match &id.local {
        Some(l) => l.encode(&mut n),
        None => n.push(0),
    }
    let count_at = n.len();
    n.push(0);
    let mut count = 0u8;
    for v in &id.opts {
        let mut one = Vec::new();
        varint(*v as u32, &mut one);
        if n.len() + one.len() > PATH_MAX {
            break;
        }
        n.extend_from_slice(&one);
        count += 1;
    }
    n[count_at] = count;
    let mut a = sockaddr_un { sun_family: AF_UNIX as u16, sun_path: [0; PATH_MAX] };
    a.sun_path[..n.len()].copy_from_slice(&n);
    (a, (2 + n.len()) as socklen_t)
}

/// The identity a `getsockname` answer (`sockaddr_un` bytes) encodes, if it is one of ours.
pub fn decode(name: &[u8]) -> Option<Identity> {
    if name.len() < 2 || u16::from_ne_bytes([name[0], name[1]]) as c_int != AF_UNIX {
        return None;
    }
    let mut r = Reader(&name[2..]);
    if r.byte()? != 0 || &r.take::<4>()? != MAGIC || r.byte()? != VERSION {
        return None;
    }
    let domain = match r.byte()? {
        4 => AF_INET,
        6 => AF_INET6,
        _ => return None,
    };
    let _unique = r.take::<8>()?;
    let peer = Addr::decode(&mut r)??;
    let local = Addr::decode(&mut r)?;
    let count = r.byte()? as usize;
    let mut opts = Vec::with_capacity(count);
    for _ in 0..count {
        opts.push(r.varint()? as i32);
    }
    Some(Identity { domain, peer, local, opts })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(ip: [u8; 4], port: u16) -> Addr {
        let mut a = [0u8; 16];
        a[..4].copy_from_slice(&ip);
        Addr { v6: false, port, ip: a, flowinfo: 0, scope: 0 }
    }

    fn name_bytes(a: &sockaddr_un, len: socklen_t) -> Vec<u8> {
        let mut b = (a.sun_family).to_ne_bytes().to_vec();
        b.extend_from_slice(&a.sun_path[..len as usize - 2]);
        b
    }

    #[test]
    fn sockaddrs_round_trip_through_addr() {
        let a = v4([198, 19, 0, 7], 29500);
        let (b, n) = a.to_sockaddr();
        assert_eq!(n, 16);
        assert_eq!(Addr::from_sockaddr(&b[..n]), Some(a));
        let mut ip = [0u8; 16];
        ip[10..].copy_from_slice(&[0xff, 0xff, 198, 19, 0, 7]);
        let a6 = Addr { v6: true, port: 1, ip, flowinfo: 5, scope: 3 };
        let (b, n) = a6.to_sockaddr();
        assert_eq!((n, Addr::from_sockaddr(&b[..n])), (28, Some(a6)));
        // Short buffers and other families are not addresses.
        assert_eq!(Addr::from_sockaddr(&b[..20]), None);
        assert_eq!(Addr::from_sockaddr(&[1, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(Addr::from_sockaddr(&[]), None);
    }

    #[test]
    fn identities_round_trip_through_the_name() {
        let mut ip6 = [0u8; 16];
        ip6[0] = 0xfd;
        ip6[15] = 7;
        let cases = [
            Identity {
                domain: AF_INET,
                peer: v4([198, 19, 0, 7], 29500),
                local: None,
                opts: vec![1, 7200, 0],
            },
            Identity {
                domain: AF_INET6,
                peer: Addr { v6: true, port: 40000, ip: ip6, flowinfo: 9, scope: 2 },
                local: Some(Addr { v6: true, port: 5, ip: ip6, flowinfo: 0, scope: 0 }),
                opts: vec![0, -1, 65535, 127],
            },
        ];
        for (k, id) in cases.iter().enumerate() {
            let (a, len) = encode(id, 0xfeed_0000 + k as u64);
            assert!(len as usize <= std::mem::size_of::<sockaddr_un>());
            assert_eq!(a.sun_path[0], 0, "abstract");
            assert_eq!(decode(&name_bytes(&a, len)).as_ref(), Some(id));
        }
    }

    #[test]
    fn options_that_do_not_fit_are_left_out_and_the_name_stays_valid() {
        let mut ip6 = [0u8; 16];
        ip6[0] = 0xfd;
        let a6 = Addr { v6: true, port: 1, ip: ip6, flowinfo: 1, scope: 1 };
        // Every option at its longest encoding (5 bytes).
        let id = Identity { domain: AF_INET6, peer: a6, local: Some(a6), opts: vec![-1; 40] };
        let (a, len) = encode(&id, 1);
        assert!(len as usize <= std::mem::size_of::<sockaddr_un>());
        let back = decode(&name_bytes(&a, len)).expect("decodes");
        assert!(!back.opts.is_empty() && back.opts.len() < 40, "{}", back.opts.len());
        assert!(back.opts.iter().all(|v| *v == -1));
        assert_eq!((back.peer, back.local), (a6, Some(a6)));
    }

    #[test]
    fn other_names_and_garbage_are_not_identities() {
        let id = Identity { domain: AF_INET, peer: v4([10, 0, 0, 1], 1), local: None, opts: vec![3] };
        let (a, len) = encode(&id, 7);
        let good = name_bytes(&a, len);
        // Every truncation fails cleanly (no panic); only the full name decodes.
        for cut in 0..good.len() {
            assert_eq!(decode(&good[..cut]), None, "cut at {cut}");
        }
        let mut path = vec![1u8, 0];
        path.extend_from_slice(b"/tmp/some.sock\0");
        assert_eq!(decode(&path), None);
        let mut wrong = good.clone();
        wrong[3] = b'X';
        assert_eq!(decode(&wrong), None);
        let mut inet = good.clone();
        inet[0] = AF_INET as u8;
        assert_eq!(decode(&inet), None);
        // Arbitrary bytes after a valid prefix never panic.
        for seed in 0u32..2000 {
            let mut g = good[..9].to_vec();
            let mut x = seed.wrapping_mul(2_654_435_761);
            for _ in 0..(seed % 90) {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                g.push(x as u8);
            }
            let _ = decode(&g);
        }
    }
}
