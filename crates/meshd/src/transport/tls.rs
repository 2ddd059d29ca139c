//! TLS for QUIC: a throw-away self-signed certificate per node, TLS 1.3 only, ALPN
//! `meshd/9` (the protocol version). Peer certificates are not trusted for identity (the token MAC in
//! [`super::auth`] is); their handshake signatures are still verified properly.

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use std::sync::Arc;

/// Builds the quinn server and client configs.
pub fn configs(
    transport: Arc<quinn::TransportConfig>,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), super::TransportError> {
    configs_with_alpn(transport, meshd_proto::wire::ALPN)
}

/// [`configs`] for another ALPN (tests speak as another protocol version).
pub(crate) fn configs_with_alpn(
    transport: Arc<quinn::TransportConfig>,
    alpn: &[u8],
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), super::TransportError> {
    let tls_err = |e: String| super::TransportError::Tls(e);
    let (server, client) = rustls_configs(alpn)?;
    let server =
        quinn::crypto::rustls::QuicServerConfig::try_from(server).map_err(|e| tls_err(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(transport.clone());
    let client =
        quinn::crypto::rustls::QuicClientConfig::try_from(client).map_err(|e| tls_err(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client));
    client.transport_config(transport);
    Ok((server, client))
}

/// The ring provider with AES-128-GCM first (rustls puts AES-256 first): every byte of a
/// collective is sealed and opened once per link, and 10 AES rounds instead of 14 cost
/// less (docs/PERFORMANCE.md, "AES-128-GCM"). It is TLS 1.3's and QUIC's
/// mandatory suite; the others stay acceptable.
fn provider() -> CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    provider
}

fn rustls_configs(
    alpn: &[u8],
) -> Result<(rustls::ServerConfig, rustls::ClientConfig), super::TransportError> {
    let tls_err = |e: String| super::TransportError::Tls(e);
    let provider = Arc::new(provider());
    let ck =
        rcgen::generate_simple_self_signed(vec!["meshd".to_string()]).map_err(|e| tls_err(e.to_string()))?;
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));

    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .map_err(|e| tls_err(e.to_string()))?;
    server.alpn_protocols = vec![alpn.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    client.alpn_protocols = vec![alpn.to_vec()];
    Ok((server, client))
}

/// Accepts any certificate but verifies the handshake signature made with its key.
#[derive(Debug)]
struct AnyCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not used by meshd".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two nodes' configs negotiate AES-128-GCM (a TLS handshake in memory: QUIC's
    /// handshake chooses the suite the same way).
    #[test]
    fn nodes_agree_on_aes_128_gcm() {
        let (server, _) = rustls_configs(b"meshd/test").expect("server config");
        let (_, client) = rustls_configs(b"meshd/test").expect("client config");
        let name = ServerName::try_from("meshd").expect("name");
        let mut c =
            rustls::Connection::from(rustls::ClientConnection::new(Arc::new(client), name).expect("client"));
        let mut s =
            rustls::Connection::from(rustls::ServerConnection::new(Arc::new(server)).expect("server"));
        // What one side has to send, handed to the other.
        fn pump(from: &mut rustls::Connection, to: &mut rustls::Connection) {
            let mut wire = Vec::new();
            while from.wants_write() {
                from.write_tls(&mut wire).expect("write");
            }
            let mut rd = &wire[..];
            while !rd.is_empty() {
                to.read_tls(&mut rd).expect("read");
            }
            to.process_new_packets().expect("handshake");
        }
        for _ in 0..10 {
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
            pump(&mut c, &mut s);
            pump(&mut s, &mut c);
        }
        assert!(!c.is_handshaking() && !s.is_handshaking(), "handshake finished");
        let suite = |x: Option<rustls::SupportedCipherSuite>| x.map(|s| s.suite());
        assert_eq!(suite(c.negotiated_cipher_suite()), Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
        assert_eq!(suite(s.negotiated_cipher_suite()), Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
    }
}
