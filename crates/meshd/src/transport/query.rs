//! What a transport tells about itself and asks of other nodes: the probe (`meshd ifaces`),
//! the status and tunnel queries (`meshd status`) and the answers it gives them, and its
//! view of the connected peers (ids, round-trip times, datagram counts, QUIC's path
//! statistics).

use super::*;

/// QUIC's view of the path to one peer ([`Transport::path_stats`]).
#[derive(Clone, Copy, Debug)]
pub struct PathStats {
    /// The UDP payload size MTU discovery has reached.
    pub mtu: u16,
    /// Smoothed round-trip time.
    pub rtt: Duration,
    /// Packets sent on the path.
    pub sent_packets: u64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Times the congestion window was cut.
    pub congestion_events: u64,
    /// UDP datagrams sent on the link (all its connections).
    pub tx_datagrams: u64,
    /// Send system calls they took (fewer per datagram = fuller GSO batches).
    pub tx_calls: u64,
    /// UDP datagrams received on the link.
    pub rx_datagrams: u64,
    /// ACK frames sent to the peer.
    pub acks_sent: u64,
    /// Open connections to the peer: the main one and its lanes (either end's).
    pub connections: usize,
}

/// What a probe learned.
#[derive(Clone, Debug)]
pub struct ProbeInfo {
    /// The peer's node id.
    pub node: NodeId,
    /// The address the peer saw us come from.
    pub observed: Option<SocketAddr>,
    /// Connect + authentication round trip.
    pub rtt: Duration,
}

impl Transport {
    /// Connects to `to`, authenticates, and reports what the peer saw. The connection is
    /// kept for later sends.
    pub async fn probe(&self, to: SocketAddr) -> Result<ProbeInfo, TransportError> {
        let start = Instant::now();
        let (_, node, observed) = connect(&self.inner, canonical(to), 0).await?;
        Ok(ProbeInfo { node, observed, rtt: start.elapsed() })
    }

    /// Sets what `meshd status` probes are told of the tunnel's counters (the tunnel
    /// depends on the transport, not the reverse: it hands over a function).
    pub fn set_tunnel_stats(&self, counters: Option<TunnelCounters>) {
        *lock(&self.inner.tunnel_stats) = counters;
    }

    /// Asks the meshd at `to` for its tunnel counters (`None`: not in tunnel mode).
    pub async fn query_tunnel(&self, to: SocketAddr) -> Result<Option<TunnelReply>, TransportError> {
        self.query(to, Query::Tunnel, 1024, "tunnel").await
    }

    /// Sets what `meshd status` probes are told.
    pub fn set_status(&self, reply: &StatusReply) {
        *lock(&self.inner.status) = Bytes::from(wire::encode(reply));
    }

    /// Asks the meshd at `to` for its view of the mesh (this transport must be a probe:
    /// run hash 0).
    pub async fn query_status(&self, to: SocketAddr) -> Result<StatusReply, TransportError> {
        self.query(to, Query::Status, wire::MAX_FRAME, "status").await
    }

    /// Asks the meshd at `to` one `query` on a stream of its own (connecting when not
    /// connected) and decodes its answer of at most `max` bytes, within the connect timeout.
    async fn query<T: serde::de::DeserializeOwned>(
        &self,
        to: SocketAddr,
        query: Query,
        max: usize,
        what: &str,
    ) -> Result<T, TransportError> {
        let to = canonical(to);
        let conn = match existing(&self.inner, to) {
            Some(c) => c,
            None => connect(&self.inner, to, 0).await?.0,
        };
        let err = |reason: String| TransportError::Peer { addr: to, reason };
        let fut = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            send.write_all(&wire::encode(&query)).await.map_err(|e| err(e.to_string()))?;
            let _ = send.finish();
            let body = recv.read_to_end(max).await.map_err(|e| err(e.to_string()))?;
            wire::decode::<T>(&body).map_err(|e| err(format!("bad {what} reply: {e}")))
        };
        tokio::time::timeout(self.inner.cfg.connect_timeout, fut)
            .await
            .map_err(|_| err(format!("no {what} answer in time")))?
    }

    /// Incoming handshakes (QUIC + authentication) in progress now.
    pub fn pending_handshakes(&self) -> usize {
        self.inner.gate.pending()
    }

    /// Node ids of the currently connected, authenticated peers, by address.
    pub fn connected(&self) -> Vec<(SocketAddr, NodeId)> {
        lock(&self.inner.conns).iter().map(|(a, (_, n))| (*a, *n)).collect()
    }

    /// The node id of the authenticated peer at `addr` (its main connection, else a data
    /// connection), if connected.
    pub fn node_at(&self, addr: SocketAddr) -> Option<NodeId> {
        let addr = canonical(addr);
        if let Some((_, n)) = lock(&self.inner.conns).get(&addr) {
            return Some(*n);
        }
        lock(&self.inner.lanes).iter().find(|((a, _), _)| *a == addr).map(|(_, (_, n))| *n)
    }

    /// Round-trip time QUIC measured to `addr`, if connected.
    pub fn rtt(&self, addr: SocketAddr) -> Option<Duration> {
        lock(&self.inner.conns).get(&canonical(addr)).map(|(c, _)| c.rtt())
    }

    /// For each connected peer, the UDP datagrams its connection has received so far:
    /// when the count moves, the peer is alive and sending, whatever else is queued.
    /// Lanes count with their peer's main connection.
    pub fn rx_datagrams(&self) -> Vec<(NodeId, u64)> {
        let conns = lock(&self.inner.conns);
        let links = lock(&self.inner.data_links);
        conns
            .iter()
            .map(|(addr, (c, n))| {
                let on_lanes: u64 = links
                    .iter()
                    .filter(|(a, ln, _)| a == addr && ln == n)
                    .map(|(_, _, l)| l.stats().udp_rx.datagrams)
                    .sum();
                (*n, c.stats().udp_rx.datagrams + on_lanes)
            })
            .collect()
    }

    /// QUIC's view of the path to `addr`, if connected: the MTU discovery reached, packets
    /// sent and lost, and congestion events.
    pub fn path_stats(&self, addr: SocketAddr) -> Option<PathStats> {
        let addr = canonical(addr);
        let main = lock(&self.inner.conns).get(&addr).map(|(c, _)| c.stats())?;
        let mut p = PathStats::from(&main);
        // Counters add up over the link's lanes; MTU and RTT are the main connection's.
        let lanes = lock(&self.inner.lanes);
        for (c, _) in
            lanes.iter().filter(|((a, _), (c, _))| *a == addr && c.close_reason().is_none()).map(|(_, c)| c)
        {
            let l = PathStats::from(&c.stats());
            p.connections += 1;
            p.sent_packets += l.sent_packets;
            p.lost_packets += l.lost_packets;
            p.congestion_events += l.congestion_events;
            p.tx_datagrams += l.tx_datagrams;
            p.tx_calls += l.tx_calls;
            p.rx_datagrams += l.rx_datagrams;
            p.acks_sent += l.acks_sent;
        }
        Some(p)
    }
}

impl From<&quinn::ConnectionStats> for PathStats {
    fn from(s: &quinn::ConnectionStats) -> Self {
        PathStats {
            mtu: s.path.current_mtu,
            rtt: s.path.rtt,
            sent_packets: s.path.sent_packets,
            lost_packets: s.path.lost_packets,
            congestion_events: s.path.congestion_events,
            tx_datagrams: s.udp_tx.datagrams,
            tx_calls: s.udp_tx.ios,
            rx_datagrams: s.udp_rx.datagrams,
            acks_sent: s.frame_tx.acks,
            connections: 1,
        }
    }
}
