//! What a transport is started with: its settings and the congestion controller.

use super::auth::Token;
use super::plane;
use meshd_proto::NodeId;
use std::net::IpAddr;
use std::time::Duration;

/// Transport settings.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// The one UDP port.
    pub port: u16,
    /// Address to bind (unspecified = all interfaces of that family).
    pub bind: IpAddr,
    /// Cluster secret; `None` = unauthenticated (still encrypted).
    pub token: Option<Token>,
    /// Hash of the run id; peers of another run are refused.
    pub run_hash: u64,
    /// This node.
    pub node: NodeId,
    /// UDP generic segmentation offload (some kernels mangle it; the CLI's `MESHD_GSO=0`).
    pub gso: bool,
    /// Congestion controller of every connection (the CLI's `MESHD_CC`).
    pub cc: CongestionControl,
    /// QUIC keep-alive.
    pub keep_alive: Duration,
    /// A silent connection is dropped after this.
    pub idle_timeout: Duration,
    /// Time allowed for connect + authentication.
    pub connect_timeout: Duration,
    /// MTU of the interface the cluster uses. Above 1500 (jumbo frames), QUIC's path MTU
    /// discovery may grow packets up to it: fewer, larger packets cost far less CPU per
    /// byte. Peers each advertise their own limit, so a mixed cluster stays safe.
    pub mtu: Option<u32>,
    /// How long a reliable frame is kept and retried while its peer cannot be reached or
    /// does not take it; then it is given up on, counted and logged. Longer than the
    /// membership's verdict on a silent peer, so that a frame is given up on only for a
    /// peer the protocols above already know is gone.
    pub reliable_horizon: Duration,
    /// Time allowed to open a stream and write one reliable frame on an established
    /// connection; past it the attempt is reset and retried.
    pub send_timeout: Duration,
    /// Run the data plane (AEAD datagrams on the same port for the ring's bulk data;
    /// `MESHD_PLANE=0` turns it off, and peers then use QUIC streams with this node).
    pub plane: bool,
    /// Lanes of the data plane, each its own driver task with its own keys (the CLI's
    /// `MESHD_LANES`; default [`plane::default_lanes`], at most
    /// [`plane::MAX_PLANE_LANES`]). A sender uses the lanes both ends run.
    pub plane_lanes: usize,
    /// Give each plane lane a socket of its own on the node's port (an `SO_REUSEPORT`
    /// group steered by the datagrams' first bytes), so that the plane reads its own
    /// datagrams; otherwise, or where the kernel refuses, they are split off from quinn's.
    pub plane_sockets: bool,
}

impl TransportConfig {
    /// Defaults for `node` on `port`.
    pub fn new(node: NodeId, port: u16) -> Self {
        TransportConfig {
            port,
            bind: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            token: None,
            run_hash: 0,
            node,
            gso: true,
            cc: CongestionControl::default(),
            keep_alive: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            mtu: None,
            plane: true,
            plane_lanes: plane::default_lanes(),
            plane_sockets: true,
            reliable_horizon: Duration::from_secs(30),
            send_timeout: Duration::from_secs(10),
        }
    }
}

/// The congestion controller QUIC runs on every connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CongestionControl {
    /// CUBIC (quinn's default).
    #[default]
    Cubic,
    /// BBR (v1, as quinn implements it).
    Bbr,
    /// NewReno.
    NewReno,
}

impl CongestionControl {
    /// The name `MESHD_CC` takes: `cubic`, `bbr`, `newreno`.
    pub fn name(self) -> &'static str {
        match self {
            CongestionControl::Cubic => "cubic",
            CongestionControl::Bbr => "bbr",
            CongestionControl::NewReno => "newreno",
        }
    }
}

impl std::fmt::Display for CongestionControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A congestion controller's name that is not one of [`CongestionControl`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown congestion control {0:?} (cubic, bbr or newreno)")]
pub struct UnknownCongestionControl(pub String);

impl std::str::FromStr for CongestionControl {
    type Err = UnknownCongestionControl;

    fn from_str(s: &str) -> Result<Self, UnknownCongestionControl> {
        match s {
            "cubic" => Ok(CongestionControl::Cubic),
            "bbr" => Ok(CongestionControl::Bbr),
            "newreno" => Ok(CongestionControl::NewReno),
            other => Err(UnknownCongestionControl(other.to_string())),
        }
    }
}
