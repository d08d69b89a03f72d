//! An HTTPS/1.1 server loop and the pieces of HTTP both ramify endpoints speak: the
//! aggregated API (`ramify-api`) and the node agents' endpoint behind it. Errors go
//! out as `metav1.Status` JSON, as every Kubernetes API answers, so `kubectl` and
//! kube clients show their message.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::ServerConfig;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// The body of every response.
pub type Body = BoxBody<Bytes, std::io::Error>;

/// A body of these bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// A response with a JSON body.
pub fn json(code: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(value.to_string()));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A `metav1.Status` failure, the way the kube-apiserver reports errors.
pub fn status(code: StatusCode, message: &str) -> Response<Body> {
    let reason = match code {
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::CONFLICT => "Conflict",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        _ => "InternalError",
    };
    json(
        code,
        &serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason,
            "code": code.as_u16(),
        }),
    )
}

/// The repeated values of one query parameter (`?command=ls&command=-l`), decoded.
pub fn query_values(req: &Request<Incoming>, key: &str) -> Vec<String> {
    form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
        .collect()
}

/// What a WebSocket upgrade request asked for.
pub struct WebSocketAccept {
    /// The 101 response to send back (accept key and chosen subprotocol set).
    pub response: Response<Body>,
    /// The subprotocol chosen.
    pub protocol: &'static str,
}

/// Checks a WebSocket upgrade request and picks the first of `protocols` the client
/// offers (`Sec-WebSocket-Protocol`); `Err` is the response refusing it (boxed: a
/// response is large and the refusal is the cold path).
pub fn accept_websocket(
    headers: &HeaderMap,
    protocols: &[&'static str],
) -> Result<WebSocketAccept, Box<Response<Body>>> {
    let has = |name: header::HeaderName, want: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(want)))
        })
    };
    if !has(header::UPGRADE, "websocket") || !has(header::CONNECTION, "upgrade") {
        return Err(Box::new(status(
            StatusCode::BAD_REQUEST,
            "this subresource is a WebSocket stream: send an Upgrade: websocket request",
        )));
    }
    let Some(key) = headers.get(header::SEC_WEBSOCKET_KEY) else {
        return Err(Box::new(status(
            StatusCode::BAD_REQUEST,
            "missing Sec-WebSocket-Key",
        )));
    };
    let offered: Vec<String> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|p| p.trim().to_string()))
        .collect();
    let Some(protocol) = protocols
        .iter()
        .find(|p| offered.iter().any(|o| o == *p))
        .copied()
    else {
        return Err(Box::new(status(
            StatusCode::BAD_REQUEST,
            &format!(
                "no supported WebSocket subprotocol offered (want one of {})",
                protocols.join(", ")
            ),
        )));
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = response.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol),
    );
    match HeaderValue::from_str(&accept) {
        Ok(v) => {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        Err(_) => {
            return Err(Box::new(status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "could not encode Sec-WebSocket-Accept",
            )));
        }
    }
    Ok(WebSocketAccept { response, protocol })
}

/// Serves HTTPS/1.1 (with upgrades) on `listener` forever. `handler` gets the
/// client's verified certificate, if it presented one, with each request. A failed
/// TLS handshake (no certificate where one is required, a wrong one) closes that
/// connection only.
pub async fn serve<H, F>(listener: TcpListener, config: Arc<ServerConfig>, handler: H)
where
    H: Fn(Option<Arc<CertificateDer<'static>>>, Request<Incoming>) -> F
        + Clone
        + Send
        + Sync
        + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let acceptor = TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        let (acceptor, handler) = (acceptor.clone(), handler.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::info!(%peer, error = %e, "TLS handshake refused");
                    return;
                }
            };
            let cert = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| Arc::new(c.clone().into_owned()));
            let service = service_fn(move |req| {
                let (handler, cert) = (handler.clone(), cert.clone());
                async move { Ok::<_, Infallible>(handler(cert, req).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .with_upgrades()
                .await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
