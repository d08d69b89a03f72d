//! `kubectl ramify port-forward NAME [LOCAL:]REMOTE...`: listens on local ports and
//! carries each connection to the remote port on the sandbox's loopback, one WebSocket
//! per connection through `subresources.ramify.dev` (RBAC: `get` on
//! `sandboxes/portforward` in the sandbox's namespace), as `kubectl port-forward` does
//! for a Pod. Runs until interrupted.

use std::process::ExitCode;

use futures::{SinkExt, StreamExt};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use ramify_crds::Sandbox;
use ramify_crds::subresources as sub;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;

use crate::{Error, Result, api_error, subresource_url};

/// One forwarded port: connections to `local` reach `remote` in the sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// 0: any free port (printed once bound).
    pub local: u16,
    pub remote: u16,
}

/// `8080` (the same port locally), `9000:8080`, or `:8080` (any free local port).
pub fn parse_mapping(s: &str) -> std::result::Result<Mapping, String> {
    let port = |p: &str, what: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("{s:?}: {what} port {p:?} is not a port (0-65535)"))
    };
    let (local, remote) = match s.split_once(':') {
        None => (port(s, "the")?, port(s, "the")?),
        Some(("", r)) => (0, port(r, "the remote")?),
        Some((l, r)) => (port(l, "the local")?, port(r, "the remote")?),
    };
    if remote == 0 {
        return Err(format!("{s:?}: the remote port must be 1-65535"));
    }
    Ok(Mapping { local, remote })
}

/// Forwards until interrupted (Ctrl-C): exit 0. Refused up front, with RBAC's exit
/// code, for a user who may not port-forward to this sandbox.
pub async fn run(
    client: &Client,
    ns: &str,
    sandbox: &str,
    mappings: &[String],
    address: &str,
) -> Result<ExitCode> {
    let mappings: Vec<Mapping> = mappings
        .iter()
        .map(|m| parse_mapping(m))
        .collect::<std::result::Result<_, _>>()
        .map_err(Error::Usage)?;
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), ns);
    sandboxes.get(sandbox).await.map_err(api_error)?;
    may_port_forward(client, ns, sandbox).await?;
    let mut accepting = Vec::new();
    for m in mappings {
        let listener = TcpListener::bind((address, m.local))
            .await
            .map_err(|e| Error::Other(format!("listening on {address}:{}: {e}", m.local)))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("listening on {address}:{}: {e}", m.local)))?;
        println!("Forwarding from {bound} -> {}", m.remote);
        let url = subresource_url(
            ns,
            sandbox,
            sub::SUBRESOURCE_PORTFORWARD,
            &[("ports", &m.remote.to_string())],
        );
        accepting.push(tokio::spawn(accept(
            client.clone(),
            listener,
            url,
            m.remote,
        )));
    }
    tokio::signal::ctrl_c()
        .await
        .map_err(|e| Error::Other(format!("waiting for Ctrl-C: {e}")))?;
    for a in accepting {
        a.abort();
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether the kubeconfig's user may port-forward to the sandbox (asked of the API
/// server's authorizer, which is what decides each connection).
async fn may_port_forward(client: &Client, ns: &str, sandbox: &str) -> Result<()> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(sub::SUBRESOURCE_GROUP.into()),
                resource: Some("sandboxes".into()),
                subresource: Some(sub::SUBRESOURCE_PORTFORWARD.into()),
                verb: Some("get".into()),
                namespace: Some(ns.into()),
                name: Some(sandbox.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answer = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(api_error)?;
    let status = answer.status.unwrap_or_default();
    if status.allowed {
        return Ok(());
    }
    Err(Error::Forbidden(format!(
        "forbidden: you cannot get sandboxes/portforward ({}) of sandbox {sandbox} in \
         namespace {ns}{}",
        sub::SUBRESOURCE_GROUP,
        status
            .reason
            .filter(|r| !r.is_empty())
            .map(|r| format!(": {r}"))
            .unwrap_or_default()
    )))
}

async fn accept(client: Client, listener: TcpListener, url: String, remote: u16) {
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    if let Err(e) = forward(&client, &url, tcp).await {
                        eprintln!("error: connection from {peer} to port {remote}: {e}");
                    }
                });
            }
            Err(e) => eprintln!("error: accepting a connection for port {remote}: {e}"),
        }
    }
}

/// Carries one local connection: its bytes out on the data channel, the sandbox's in,
/// until either side ends.
async fn forward(client: &Client, url: &str, mut tcp: TcpStream) -> Result<()> {
    let req = http::Request::get(url)
        .body(Vec::new())
        .map_err(|e| Error::Other(e.to_string()))?;
    // The API's refusal, as its message alone (the sandbox says what is wrong).
    let ws = client
        .connect(req)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if !s.message.is_empty() => Error::Other(s.message),
            other => api_error(other),
        })?
        .into_stream();
    let (mut tx, mut rx) = ws.split();
    let (mut from, mut to) = tcp.split();
    // The server opens each channel with its port (two bytes): not data.
    let mut opened = [false, false];
    let mut local_open = true;
    let mut buf = vec![0u8; 32 << 10];
    loop {
        tokio::select! {
            n = from.read(buf.get_mut(1..).unwrap_or_default()), if local_open => match n {
                // The local side is done writing; the sandbox may still answer.
                Ok(0) | Err(_) => local_open = false,
                Ok(n) => {
                    if let Some(b) = buf.first_mut() {
                        *b = sub::CHANNEL_PF_DATA;
                    }
                    let frame = buf.get(..=n).unwrap_or_default().to_vec();
                    tx.send(Message::Binary(frame.into()))
                        .await
                        .map_err(|e| Error::Other(format!("sending: {e}")))?;
                }
            },
            m = rx.next() => match m {
                Some(Ok(Message::Binary(b))) => {
                    let Some((&channel, body)) = b.split_first() else { continue };
                    let Some(seen) = opened.get_mut(usize::from(channel)) else { continue };
                    if !*seen {
                        *seen = true;
                        continue;
                    }
                    if channel == sub::CHANNEL_PF_DATA {
                        if to.write_all(body).await.is_err() {
                            break; // the local side closed
                        }
                    } else if !body.is_empty() {
                        return Err(Error::Other(String::from_utf8_lossy(body).into_owned()));
                    }
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(Error::Other(format!("port-forward stream: {e}"))),
            },
        }
    }
    let _ = tx.close().await;
    let _ = to.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_read_as_kubectl_port_forward_reads_them() {
        let m = |local, remote| Ok(Mapping { local, remote });
        assert_eq!(parse_mapping("8080"), m(8080, 8080));
        assert_eq!(parse_mapping("9000:8080"), m(9000, 8080));
        assert_eq!(parse_mapping(":8080"), m(0, 8080));
        for bad in ["", "http", "9000:", "70000:80", "80:0", "1:2:3"] {
            assert!(parse_mapping(bad).is_err(), "{bad:?}");
        }
    }
}
