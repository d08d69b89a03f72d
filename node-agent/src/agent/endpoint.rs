//! The node endpoint: exec, log and diff of this node's sandboxes, for `ramify-api`
//! only. It listens on `--endpoint-listen` with mutual TLS: the handshake fails for a
//! client whose certificate does not chain to `--endpoint-client-ca` or does not name
//! `ramify-api`, so nobody reaches a sandbox through the node without passing the
//! API's RBAC check first (and nobody needs `pods/exec` on the privileged agent). The
//! agent announces the endpoint's address on its node Lease.
//!
//! Paths (`GET`, below `/v1`): `namespaces/{ns}/sandboxes/{name}/exec?command=...`
//! (a WebSocket with the Kubernetes channel protocol, output streamed as it comes,
//! with `stdin=true` and `tty=true` as a Pod exec's: see [`super::exec_stream`]),
//! `.../log?follow=true&tailLines=N&sinceSeconds=S` (the console log, streamed; following),
//! `.../diff?path=GLOB` (JSON) and `.../portforward?ports=P` (a WebSocket carrying one
//! TCP connection to port P on the sandbox's loopback; see
//! [`ramify_crds::subresources`] for its framing).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use ramify_crds::subresources::{
    self as sub, CHANNEL_PF_DATA, CHANNEL_PF_ERROR, EXEC_PROTOCOLS, PORTFORWARD_PROTOCOLS,
};
use ramify_runtime::https::{self, Body};
use ramify_runtime::tls::{self, ClientAuth, TlsError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tracing::{info, warn};

use super::idle::Activity;
use super::registry::Registry;
use super::stream_limit::{Kind, StreamLimits};
use ramify_engine::engine::{Engine, LocalSandbox};
use ramify_engine::freezer::Look;

/// Where and how the endpoint listens.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    pub listen: SocketAddr,
    /// The host the API dials (the node's or pod's IP); default: the listen address.
    pub advertise_host: Option<String>,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA of the `ramify-api` client certificate.
    pub client_ca: PathBuf,
}

/// Why the endpoint could not start, or a request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("endpoint listen {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "--endpoint-listen {0} is a wildcard address: give --endpoint-advertise (the address ramify-api dials)"
    )]
    NoAdvertise(SocketAddr),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Agent(#[from] crate::Error),
}

impl From<ramify_engine::Error> for EndpointError {
    fn from(e: ramify_engine::Error) -> Self {
        EndpointError::Agent(e.into())
    }
}

/// A bound endpoint, ready to serve.
pub struct Endpoint {
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    /// What the agent announces: `https://host:port`.
    pub url: String,
}

impl Endpoint {
    pub async fn bind(cfg: &EndpointConfig) -> Result<Self, EndpointError> {
        let config = tls::server_config(
            &cfg.cert,
            &cfg.key,
            ClientAuth::RequiredNamed(
                tls::roots_from_file(&cfg.client_ca)?,
                sub::TLS_NAME_API_CLIENT.to_string(),
            ),
        )?;
        let listener =
            TcpListener::bind(cfg.listen)
                .await
                .map_err(|source| EndpointError::Listen {
                    addr: cfg.listen,
                    source,
                })?;
        let local = listener
            .local_addr()
            .map_err(|source| EndpointError::Listen {
                addr: cfg.listen,
                source,
            })?;
        let host = match &cfg.advertise_host {
            Some(h) if h.contains(':') => format!("[{h}]"),
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => return Err(EndpointError::NoAdvertise(local)),
            None => match local.ip() {
                std::net::IpAddr::V4(ip) => ip.to_string(),
                std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            },
        };
        let url = format!("https://{host}:{}", local.port());
        info!(%url, "node endpoint listening (mTLS, ramify-api only)");
        Ok(Endpoint {
            listener,
            config: Arc::new(config),
            url,
        })
    }

    /// Serves until the process ends.
    pub async fn serve(self, engine: Engine, registry: Registry, activity: Arc<Activity>) {
        let state = Arc::new(State {
            engine,
            registry,
            activity,
            streams: Arc::default(),
        });
        https::serve(self.listener, self.config, move |_cert, req| {
            let state = state.clone();
            async move { state.handle(req).await }
        })
        .await;
    }
}

struct State {
    engine: Engine,
    registry: Registry,
    /// Execs count as activity (idle suspend); an exec wakes an idle sandbox.
    activity: Arc<Activity>,
    /// Streams open per sandbox, within limits.
    streams: Arc<StreamLimits>,
}

/// How long an exec waits for an idle-suspended sandbox to wake.
const WAKE_TIMEOUT: Duration = Duration::from_secs(120);

/// The local sandbox that backs Sandbox `namespace/name` on this node (what the agent
/// recorded in its registry).
pub async fn local_sandbox(
    engine: &Engine,
    registry: &Registry,
    namespace: &str,
    name: &str,
) -> Result<LocalSandbox, EndpointError> {
    let rec = registry
        .sandboxes()?
        .records
        .into_iter()
        .find(|r| r.namespace == namespace && r.name == name && !r.handed_over)
        .ok_or_else(|| {
            EndpointError::NotFound(format!("no sandbox {namespace}/{name} on this node"))
        })?;
    engine
        .recover()
        .await?
        .sandboxes
        .into_iter()
        .find(|s| s.id == rec.sandbox_id)
        .ok_or_else(|| {
            EndpointError::NotFound(format!(
                "sandbox {namespace}/{name} ({}) has no local state",
                rec.sandbox_id
            ))
        })
}

impl State {
    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        if req.method() != Method::GET {
            return https::status(StatusCode::METHOD_NOT_ALLOWED, "only GET is served");
        }
        let path = req.uri().path().to_string();
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let ["v1", "namespaces", ns, "sandboxes", name, what] = parts[..] else {
            return https::status(StatusCode::NOT_FOUND, &format!("no such path {path}"));
        };
        let sb = match local_sandbox(&self.engine, &self.registry, ns, name).await {
            Ok(sb) => sb,
            Err(e) => return error_response(&e),
        };
        // Idle-suspended: an exec or a port-forward wakes it, and runs once it runs
        // again.
        let wakes = what == sub::SUBRESOURCE_EXEC || what == sub::SUBRESOURCE_PORTFORWARD;
        let sb = if sb.suspended.is_some() && wakes {
            match self.wake_idle(ns, name, sb).await {
                Ok(sb) => sb,
                Err(e) => return error_response(&e),
            }
        } else {
            sb
        };
        if sb.suspended.is_some() && what != sub::SUBRESOURCE_LOG {
            // Nothing of it runs to exec in or look at; its log is still on disk.
            return https::status(
                StatusCode::CONFLICT,
                &format!(
                    "sandbox {ns}/{name} is suspended: set spec.suspended to false to resume it"
                ),
            );
        }
        match what {
            sub::SUBRESOURCE_EXEC => self.exec(&mut req, sb),
            sub::SUBRESOURCE_PORTFORWARD => {
                self.port_forward(&mut req, sb, &format!("{ns}/{name}"))
                    .await
            }
            sub::SUBRESOURCE_LOG => {
                let opts = match super::console_log::LogOptions::parse(
                    |k| https::query_values(&req, k),
                    std::time::SystemTime::now(),
                ) {
                    Ok(o) => o,
                    Err(why) => return https::status(StatusCode::BAD_REQUEST, &why),
                };
                self.log(sb, opts)
            }
            sub::SUBRESOURCE_DIFF => {
                let mut globs = https::query_values(&req, "path");
                if globs.is_empty() {
                    globs.push("/**".into());
                }
                // A decided branch is frozen: thawed for the look, frozen again after.
                let look = match self.engine.look(&sb).await {
                    Ok(l) => l,
                    Err(e) => return error_response(&e.into()),
                };
                let diff = self.engine.diff_since_restore(&sb, &globs).await;
                if let Err(e) = look.end().await {
                    warn!(sandbox = %sb.id, error = %e, "refreezing after a diff failed");
                }
                match diff {
                    Ok(d) => match serde_json::to_value(&d) {
                        Ok(v) => https::json(StatusCode::OK, &v),
                        Err(e) => error_response(&crate::Error::from(e).into()),
                    },
                    Err(e) => error_response(&e.into()),
                }
            }
            other => https::status(StatusCode::NOT_FOUND, &format!("no subresource {other}")),
        }
    }

    /// `sb` is suspended: when it was for idleness, its mark is cleared, its
    /// reconcile asked for, and it is returned once it runs again. Otherwise (or when
    /// it does not wake in time) it is returned as it is, or an error.
    async fn wake_idle(
        &self,
        ns: &str,
        name: &str,
        sb: LocalSandbox,
    ) -> Result<LocalSandbox, EndpointError> {
        let Some(rec) = self
            .registry
            .sandboxes()?
            .records
            .into_iter()
            .find(|r| r.namespace == ns && r.name == name && r.idle_suspended)
        else {
            return Ok(sb);
        };
        info!(sandbox = %format!("{ns}/{name}"), "an exec wakes an idle sandbox");
        self.registry
            .update_sandbox(&rec.uid, |r| r.idle_suspended = false)?;
        self.activity.wake(ns, name);
        let deadline = tokio::time::Instant::now() + WAKE_TIMEOUT;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = local_sandbox(&self.engine, &self.registry, ns, name).await?;
            if now.suspended.is_none() && self.engine.is_running(&now).await.unwrap_or(false) {
                return Ok(now);
            }
            if tokio::time::Instant::now() > deadline {
                return Ok(now); // still suspended: refused below, saying so
            }
        }
    }

    fn exec(&self, req: &mut Request<Incoming>, sb: LocalSandbox) -> Response<Body> {
        let argv = https::query_values(req, "command");
        let attach = super::exec_stream::Attach::parse(
            &https::query_values(req, "stdin"),
            &https::query_values(req, "tty"),
        );
        let cmd = match self.engine.exec_command(&sb, &argv, attach.tty) {
            Ok(c) => c,
            Err(e) => return error_response(&e.into()),
        };
        let accept = match https::accept_websocket(req.headers(), &EXEC_PROTOCOLS) {
            Ok(a) => a,
            Err(refused) => return *refused,
        };
        let stream = match self.streams.open(&sb.id, &sb.name, Kind::Exec) {
            Ok(s) => s,
            Err(why) => return https::status(StatusCode::TOO_MANY_REQUESTS, &why),
        };
        let upgrade = hyper::upgrade::on(req);
        let id = sb.id.clone();
        let runsc = self.engine.runsc().clone();
        // Activity from here to the exec's end: the sandbox is not idle meanwhile.
        let busy = self.activity.exec(&sb.id);
        tokio::spawn(async move {
            match upgrade.await {
                Ok(up) => {
                    let ws = WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Server, None)
                        .await;
                    // A decided branch is frozen: thawed for the look (the whole exec),
                    // frozen again after.
                    match Look::begin(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path()).await {
                        Ok(look) => {
                            super::exec_stream::run(ws, cmd, attach).await;
                            drop(busy);
                            drop(stream);
                            if let Err(e) = look.end().await {
                                warn!(sandbox = %id, error = %e, "refreezing after an exec failed");
                            }
                        }
                        Err(e) => {
                            let (mut tx, _) = ws.split();
                            let _ = super::exec_stream::send_status(
                                &mut tx,
                                &sub::exec_failure(&e.to_string()),
                            )
                            .await;
                        }
                    }
                }
                Err(e) => warn!(sandbox = %id, error = %e, "exec upgrade failed"),
            }
        });
        accept.response
    }

    /// One TCP connection to a port on the sandbox's loopback, carried by the
    /// WebSocket. Connected before the upgrade, so "nothing listens there" reaches the
    /// client as an HTTP error. A decided (paused) branch is resumed for the
    /// connection's life and paused again after; the connection counts as activity.
    async fn port_forward(
        &self,
        req: &mut Request<Incoming>,
        sb: LocalSandbox,
        display: &str,
    ) -> Response<Body> {
        let port = match sub::forwarded_port(&https::query_values(req, "ports")) {
            Ok(p) => p,
            Err(why) => return https::status(StatusCode::BAD_REQUEST, &why),
        };
        let accept = match https::accept_websocket(req.headers(), &PORTFORWARD_PROTOCOLS) {
            Ok(a) => a,
            Err(refused) => return *refused,
        };
        let stream = match self.streams.open(&sb.id, &sb.name, Kind::PortForward) {
            Ok(s) => s,
            Err(why) => return https::status(StatusCode::TOO_MANY_REQUESTS, &why),
        };
        let look = match self.engine.look(&sb).await {
            Ok(l) => l,
            Err(e) => return error_response(&e.into()),
        };
        let conn = match self.engine.port_forward(&sb, port).await {
            Ok(c) => c,
            Err(e) => {
                if let Err(e) = look.end().await {
                    warn!(sandbox = %sb.id, error = %e, "pausing again after a refused port-forward failed");
                }
                // Said with the sandbox's name, not the node's id for it.
                let (code, why) = match e {
                    ramify_engine::Error::Invalid(why) => (StatusCode::CONFLICT, why),
                    ramify_engine::Error::Sandbox { reason, .. } => {
                        (StatusCode::BAD_GATEWAY, reason)
                    }
                    other => (StatusCode::BAD_GATEWAY, other.to_string()),
                };
                return https::status(code, &format!("sandbox {display}: {why}"));
            }
        };
        let upgrade = hyper::upgrade::on(req);
        let id = sb.id.clone();
        let busy = self.activity.exec(&sb.id);
        tokio::spawn(async move {
            match upgrade.await {
                Ok(up) => {
                    let ws = WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Server, None)
                        .await;
                    relay_port(ws, conn, port).await;
                }
                Err(e) => warn!(sandbox = %id, error = %e, "port-forward upgrade failed"),
            }
            drop(busy);
            drop(stream);
            if let Err(e) = look.end().await {
                warn!(sandbox = %id, error = %e, "pausing again after a port-forward failed");
            }
        });
        accept.response
    }

    /// The console log, streamed (see [`super::console_log`]): following, until the
    /// sandbox stops running or the client goes.
    fn log(&self, sb: LocalSandbox, opts: super::console_log::LogOptions) -> Response<Body> {
        let path = self.engine.log_path(&sb);
        let engine = self.engine.clone();
        let sb = Arc::new(sb);
        let alive = move || {
            let (engine, sb) = (engine.clone(), sb.clone());
            async move { engine.is_running(&sb).await.unwrap_or(false) }
        };
        let chunks = futures::StreamExt::map(super::console_log::stream(path, opts, alive), |c| {
            c.map(Frame::data)
        });
        let mut r = Response::new(BodyExt::boxed(StreamBody::new(chunks)));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    }
}

fn error_response(e: &EndpointError) -> Response<Body> {
    let code = match e {
        EndpointError::NotFound(_) => StatusCode::NOT_FOUND,
        // A request the sandbox cannot serve (no command, no baseline for a diff).
        EndpointError::Agent(crate::Error::Engine(ramify_engine::Error::Invalid(_))) => {
            StatusCode::CONFLICT
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    https::status(code, &e.to_string())
}

/// Carries one port-forward connection: the server's bytes out on the data channel,
/// the client's data-channel bytes in, until either side ends (the kubelet's framing:
/// each channel opens with the port).
async fn relay_port<S>(ws: WebSocketStream<S>, conn: tokio::net::UnixStream, port: u16)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut tx, mut rx) = ws.split();
    for channel in [CHANNEL_PF_DATA, CHANNEL_PF_ERROR] {
        let prefix = sub::port_prefix(channel, port).to_vec();
        if tx.send(Message::Binary(prefix.into())).await.is_err() {
            return;
        }
    }
    let (mut from, mut to) = conn.into_split();
    let mut buf = vec![0u8; 32 << 10];
    loop {
        tokio::select! {
            n = from.read(buf.get_mut(1..).unwrap_or_default()) => match n {
                // The server closed the connection.
                Ok(0) => break,
                Ok(n) => {
                    if let Some(b) = buf.first_mut() {
                        *b = CHANNEL_PF_DATA;
                    }
                    let frame = buf.get(..=n).unwrap_or_default().to_vec();
                    if tx.send(Message::Binary(frame.into())).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let mut frame = vec![CHANNEL_PF_ERROR];
                    frame.extend_from_slice(format!("reading from port {port}: {e}").as_bytes());
                    let _ = tx.send(Message::Binary(frame.into())).await;
                    break;
                }
            },
            incoming = rx.next() => match incoming {
                Some(Ok(Message::Binary(b))) => {
                    if let Some((&CHANNEL_PF_DATA, data)) = b.split_first()
                        && to.write_all(data).await.is_err()
                    {
                        break;
                    }
                }
                Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
            },
        }
    }
    let _ = tx.close().await;
}
