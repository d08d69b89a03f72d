//! The HTTP side of ramify-api: discovery documents, and the four subresources,
//! each authenticated (front proxy), authorized (SubjectAccessReview) and then
//! relayed to the sandbox's node agent.

use std::sync::Arc;

use futures::{SinkExt, StreamExt};
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use ramify_crds::subresources::{
    self as sub, SUBRESOURCE_GROUP, SUBRESOURCE_VERSION, SUBRESOURCES,
};
use ramify_runtime::https::{self, Body};
use rustls::pki_types::CertificateDer;
use serde_json::json;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::{self, ClientRequestBuilder};
use tracing::{info, warn};

use crate::agents::{AgentError, Agents};
use crate::authn::{AuthnError, FrontProxy};
use crate::authz;

/// What every request needs.
pub struct Api {
    pub client: kube::Client,
    pub front_proxy: FrontProxy,
    pub agents: Agents,
}

fn group_version() -> String {
    format!("{SUBRESOURCE_GROUP}/{SUBRESOURCE_VERSION}")
}

fn api_group() -> serde_json::Value {
    let gv = json!({"groupVersion": group_version(), "version": SUBRESOURCE_VERSION});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": SUBRESOURCE_GROUP,
           "versions": [gv], "preferredVersion": gv})
}

fn resource_list() -> serde_json::Value {
    let resources: Vec<_> = SUBRESOURCES
        .iter()
        .map(|s| {
            json!({"name": format!("sandboxes/{s}"), "singularName": "", "namespaced": true,
                   "kind": "Sandbox", "verbs": ["get"]})
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version(),
           "resources": resources})
}

impl Api {
    pub async fn handle(
        self: Arc<Self>,
        cert: Option<Arc<CertificateDer<'static>>>,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let path = req.uri().path().to_string();
        // Probes carry no identity and reveal nothing.
        if path == "/healthz" || path == "/readyz" {
            return Response::new(https::full("ok"));
        }
        let user = match self.front_proxy.user(cert.as_deref(), req.headers()) {
            Ok(u) => u,
            Err(AuthnError::Unauthenticated(m)) => {
                info!(%path, reason = %m, "unauthenticated request refused");
                return https::status(StatusCode::UNAUTHORIZED, &m);
            }
            Err(e) => return https::status(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        };
        let prefix = format!("/apis/{}", group_version());
        match path.trim_end_matches('/') {
            "/apis" => {
                return https::json(
                    StatusCode::OK,
                    &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]}),
                );
            }
            p if p == format!("/apis/{SUBRESOURCE_GROUP}") => {
                return https::json(StatusCode::OK, &api_group());
            }
            p if p == prefix => return https::json(StatusCode::OK, &resource_list()),
            _ => {}
        }
        let rest = path.strip_prefix(&prefix).unwrap_or("");
        let parts: Vec<&str> = rest.trim_matches('/').split('/').collect();
        let ["namespaces", ns, "sandboxes", name, subresource] = parts[..] else {
            return https::status(StatusCode::NOT_FOUND, &format!("no such path {path}"));
        };
        if !SUBRESOURCES.contains(&subresource) {
            return https::status(
                StatusCode::NOT_FOUND,
                &format!(
                    "sandboxes have no subresource {subresource:?} (try exec, log, diff or portforward)"
                ),
            );
        }
        // The verb the API server's own authorization used for this request.
        let verb = match *req.method() {
            Method::GET => "get",
            _ => {
                return https::status(StatusCode::METHOD_NOT_ALLOWED, "only GET is served");
            }
        };
        let ask = authz::Request {
            verb,
            namespace: ns,
            name,
            subresource,
        };
        match authz::check(&self.client, &user, &ask).await {
            Ok(Ok(())) => {}
            Ok(Err(denied)) => {
                info!(user = %user.name, namespace = ns, sandbox = name, subresource, "forbidden");
                return https::status(StatusCode::FORBIDDEN, &denied);
            }
            Err(e) => {
                return https::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("SubjectAccessReview: {e}"),
                );
            }
        }
        let endpoint = match self.agents.endpoint_of(ns, name).await {
            Ok(e) => e,
            Err(e) => return agent_error(&e),
        };
        info!(user = %user.name, namespace = ns, sandbox = name, subresource, "allowed");
        let agent_path = format!(
            "{}{}",
            sub::subresource_path("/v1", ns, name, subresource),
            req.uri()
                .query()
                .map(|q| format!("?{q}"))
                .unwrap_or_default()
        );
        if sub::STREAMED.contains(&subresource) {
            self.stream(req, &endpoint, &agent_path, sub::protocols_of(subresource))
                .await
        } else {
            self.forward(&endpoint, &agent_path).await
        }
    }

    /// Opens the WebSocket (exec, port-forward) to the agent first (so its refusals
    /// reach the client as HTTP errors), then accepts the client's and relays messages
    /// both ways.
    async fn stream(
        &self,
        mut req: Request<Incoming>,
        endpoint: &str,
        agent_path: &str,
        protocols: &[&'static str],
    ) -> Response<Body> {
        let accept = match https::accept_websocket(req.headers(), protocols) {
            Ok(a) => a,
            Err(refused) => return *refused,
        };
        let stream = match self.agents.connect(endpoint).await {
            Ok(s) => s,
            Err(e) => return agent_error(&e),
        };
        let uri: http::Uri = match format!("wss://{}{agent_path}", sub::TLS_NAME_AGENT).parse() {
            Ok(u) => u,
            Err(e) => return https::status(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let request = ClientRequestBuilder::new(uri).with_sub_protocol(accept.protocol);
        let agent_ws = match tokio_tungstenite::client_async(request, stream).await {
            Ok((ws, _)) => ws,
            Err(tungstenite::Error::Http(resp)) => {
                let (parts, body) = resp.into_parts();
                let mut r = Response::new(https::full(body.unwrap_or_default()));
                *r.status_mut() = parts.status;
                if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
                    r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
                }
                return r;
            }
            Err(e) => {
                return agent_error(&AgentError::Unreachable {
                    endpoint: endpoint.to_string(),
                    reason: e.to_string(),
                });
            }
        };
        let upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            match upgrade.await {
                Ok(up) => {
                    let client_ws =
                        WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Server, None)
                            .await;
                    relay(client_ws, agent_ws).await;
                }
                Err(e) => warn!(error = %e, "WebSocket upgrade from the API server failed"),
            }
        });
        accept.response
    }

    /// A plain GET to the agent, its response streamed back as it comes.
    async fn forward(&self, endpoint: &str, agent_path: &str) -> Response<Body> {
        let stream = match self.agents.connect(endpoint).await {
            Ok(s) => s,
            Err(e) => return agent_error(&e),
        };
        let unreachable = |reason: String| {
            agent_error(&AgentError::Unreachable {
                endpoint: endpoint.to_string(),
                reason,
            })
        };
        let (mut sender, conn) =
            match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                Ok(x) => x,
                Err(e) => return unreachable(e.to_string()),
            };
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                warn!(error = %e, "agent connection failed");
            }
        });
        let req = match Request::get(agent_path)
            .header(header::HOST, sub::TLS_NAME_AGENT)
            .body(https::full(bytes::Bytes::new()))
        {
            Ok(r) => r,
            Err(e) => return https::status(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        match sender.send_request(req).await {
            Ok(resp) => resp.map(|b| b.map_err(std::io::Error::other).boxed()),
            Err(e) => unreachable(e.to_string()),
        }
    }
}

fn agent_error(e: &AgentError) -> Response<Body> {
    let code = match e {
        AgentError::NotFound { .. } => StatusCode::NOT_FOUND,
        AgentError::NotBound(_) => StatusCode::CONFLICT,
        AgentError::NoEndpoint(_) | AgentError::Unreachable { .. } => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        AgentError::Kube(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    https::status(code, &e.to_string())
}

/// Copies WebSocket messages between the client (through the API server) and the
/// agent until either side ends.
async fn relay<A, B>(client: WebSocketStream<A>, agent: WebSocketStream<B>)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut client_tx, mut client_rx) = client.split();
    let (mut agent_tx, mut agent_rx) = agent.split();
    loop {
        tokio::select! {
            m = agent_rx.next() => match m {
                Some(Ok(m)) if !m.is_close() => {
                    if client_tx.send(m).await.is_err() { break; }
                }
                _ => break,
            },
            m = client_rx.next() => match m {
                Some(Ok(m)) if !m.is_close() => {
                    if agent_tx.send(m).await.is_err() { break; }
                }
                _ => break,
            },
        }
    }
    let _ = client_tx.close().await;
    let _ = agent_tx.close().await;
}
