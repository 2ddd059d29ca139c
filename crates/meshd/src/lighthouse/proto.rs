//! torchft's Lighthouse messages (proto/torchft.proto, package `torchft`), written by hand
//! as prost structs: no build script, no protoc. Field numbers are torchft HEAD's (a
//! superset of 0.2.0's: proto3 skips fields it does not know, both ways).

use std::time::{SystemTime, UNIX_EPOCH};

use meshd_proto::lighthouse::{Member, Quorum as CoreQuorum};

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds within the second.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Timestamp {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 },
            Err(_) => Timestamp { seconds: 0, nanos: 0 },
        }
    }
}

/// `torchft.QuorumMember`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct QuorumMember {
    #[prost(string, tag = "1")]
    pub replica_id: String,
    #[prost(string, tag = "2")]
    pub address: String,
    #[prost(string, tag = "3")]
    pub store_address: String,
    #[prost(int64, tag = "4")]
    pub step: i64,
    #[prost(uint64, tag = "5")]
    pub world_size: u64,
    #[prost(bool, tag = "6")]
    pub shrink_only: bool,
    /// User data, a JSON string.
    #[prost(string, tag = "7")]
    pub data: String,
    /// Not in torchft 0.2.0 (absent means 0).
    #[prost(int64, tag = "8")]
    pub commit_failures: i64,
}

/// `torchft.Quorum`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Quorum {
    #[prost(int64, tag = "1")]
    pub quorum_id: i64,
    #[prost(message, repeated, tag = "2")]
    pub participants: Vec<QuorumMember>,
    /// Always set: torchft's Python client unwraps it.
    #[prost(message, optional, tag = "3")]
    pub created: Option<Timestamp>,
}

/// `torchft.LighthouseQuorumRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LighthouseQuorumRequest {
    #[prost(message, optional, tag = "1")]
    pub requester: Option<QuorumMember>,
}

/// `torchft.LighthouseQuorumResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LighthouseQuorumResponse {
    #[prost(message, optional, tag = "1")]
    pub quorum: Option<Quorum>,
}

/// `torchft.LighthouseHeartbeatRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LighthouseHeartbeatRequest {
    #[prost(string, tag = "1")]
    pub replica_id: String,
}

/// `torchft.LighthouseHeartbeatResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LighthouseHeartbeatResponse {}

/// Both ways between two structs with the same fields, the list written once.
macro_rules! convert_both_ways {
    ($a:ident <-> $b:ident: $($field:ident),+ $(,)?) => {
        impl From<$a> for $b {
            fn from(m: $a) -> $b {
                $b { $($field: m.$field),+ }
            }
        }

        impl From<$b> for $a {
            fn from(m: $b) -> $a {
                $a { $($field: m.$field),+ }
            }
        }
    };
}

convert_both_ways!(QuorumMember <-> Member:
    replica_id, address, store_address, step, world_size, shrink_only, data, commit_failures);

impl Quorum {
    /// The wire form of a core quorum, created at `created`.
    pub fn from_core(q: CoreQuorum, created: SystemTime) -> Quorum {
        Quorum {
            quorum_id: q.quorum_id,
            participants: q.participants.into_iter().map(QuorumMember::from).collect(),
            created: Some(created.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Bytes as protoc encodes them (field numbers and wire types checked by hand).
    #[test]
    fn field_numbers_match_torchft_proto() {
        let m = QuorumMember {
            replica_id: "a".into(),
            address: "b".into(),
            store_address: "c".into(),
            step: 4,
            world_size: 5,
            shrink_only: true,
            data: "d".into(),
            commit_failures: 8,
        };
        let bytes = m.encode_to_vec();
        // Prost writes fields in tag order: 1,2,3,4,5,6,7,8.
        assert_eq!(
            bytes,
            [0x0a, 1, b'a', 0x12, 1, b'b', 0x1a, 1, b'c', 0x20, 4, 0x28, 5, 0x30, 1, 0x3a, 1, b'd', 0x40, 8]
        );
        let q =
            Quorum { quorum_id: 3, participants: vec![], created: Some(Timestamp { seconds: 1, nanos: 2 }) };
        assert_eq!(q.encode_to_vec(), [0x08, 3, 0x1a, 4, 0x08, 1, 0x10, 2]);
        let hb = LighthouseHeartbeatRequest { replica_id: "r".into() };
        assert_eq!(hb.encode_to_vec(), [0x0a, 1, b'r']);
    }

    #[test]
    fn unknown_fields_are_skipped() {
        // replica_id, then an unknown field 15 (varint), as a newer torchft might send.
        let bytes = [0x0a, 1, b'x', 0x78, 7];
        let m = QuorumMember::decode(&bytes[..]).expect("decode");
        assert_eq!(m.replica_id, "x");
    }
}
