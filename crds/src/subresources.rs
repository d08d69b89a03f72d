//! The `subresources.ramify.dev` API: exec, log, diff and port-forward of a Sandbox,
//! served by `ramify-api` behind the kube-apiserver (an aggregated API, as KubeVirt's
//! `subresources.kubevirt.io`), so RBAC on `sandboxes/exec`, `sandboxes/log`,
//! `sandboxes/diff` and `sandboxes/portforward` in the sandbox's namespace decides who
//! may use them. The node
//! agent does the work behind an mTLS endpoint that only `ramify-api` can call.
//!
//! Exec streams over a WebSocket with the Kubernetes channel protocol
//! (`v4.channel.k8s.io` / `v5.channel.k8s.io`): every binary message starts with its
//! channel byte; the last message on [`CHANNEL_STATUS`] is a `metav1.Status` whose
//! `details.causes` carry the exit code, as `pods/exec` reports it. With `stdin=true`
//! the client's [`CHANNEL_STDIN`] messages are the command's stdin, ended (v5) by
//! `[CHANNEL_CLOSE, CHANNEL_STDIN]`; with `tty=true` the command has a terminal, whose
//! output comes on [`CHANNEL_STDOUT`] alone and whose size [`CHANNEL_RESIZE`] sets.
//!
//! Port-forward (`portforward?ports=P`) is one TCP connection to port `P` on the
//! sandbox's loopback per WebSocket, framed as the kubelet frames a Pod's WebSocket
//! port-forward (`v4.channel.k8s.io`): channel [`CHANNEL_PF_DATA`] carries the bytes
//! both ways, [`CHANNEL_PF_ERROR`] the reason a connection failed or ended badly, and
//! the server's first message on each channel is the port, two bytes little-endian.

use serde_json::{Value, json};

/// The aggregated API group.
pub const SUBRESOURCE_GROUP: &str = "subresources.ramify.dev";
/// Its only version.
pub const SUBRESOURCE_VERSION: &str = "v1alpha1";
/// Subresources of `sandboxes` in that group (each an RBAC resource
/// `sandboxes/<name>`).
pub const SUBRESOURCE_EXEC: &str = "exec";
pub const SUBRESOURCE_LOG: &str = "log";
pub const SUBRESOURCE_DIFF: &str = "diff";
pub const SUBRESOURCE_PORTFORWARD: &str = "portforward";
pub const SUBRESOURCES: [&str; 4] = [
    SUBRESOURCE_EXEC,
    SUBRESOURCE_LOG,
    SUBRESOURCE_DIFF,
    SUBRESOURCE_PORTFORWARD,
];
/// The subresources that are WebSocket streams (the others are plain GETs).
pub const STREAMED: [&str; 2] = [SUBRESOURCE_EXEC, SUBRESOURCE_PORTFORWARD];

/// Annotation on a node-agent Lease: the agent's mTLS endpoint (`https://host:port`).
pub const ANNOTATION_AGENT_ENDPOINT: &str = "ramify.dev/endpoint";
/// The DNS name (subjectAltName) in the certificate `ramify-api` presents to agents:
/// an agent serves no other client.
pub const TLS_NAME_API_CLIENT: &str = "ramify-api";
/// The DNS name in the agents' serving certificate (one certificate for every node:
/// the API checks this name, not the address it dialled).
pub const TLS_NAME_AGENT: &str = "ramify-node-agent";

/// WebSocket subprotocols spoken on exec, preferred first.
pub const EXEC_PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];
pub const CHANNEL_STDIN: u8 = 0;
pub const CHANNEL_STDOUT: u8 = 1;
pub const CHANNEL_STDERR: u8 = 2;
pub const CHANNEL_STATUS: u8 = 3;
/// A terminal's new size, `{"Width":W,"Height":H}` (with `tty=true`).
pub const CHANNEL_RESIZE: u8 = 4;
/// v5 only: `[CHANNEL_CLOSE, channel]` closes a channel (stdin's end of file).
pub const CHANNEL_CLOSE: u8 = 255;

/// WebSocket subprotocols spoken on port-forward (the kubelet's for a Pod).
pub const PORTFORWARD_PROTOCOLS: [&str; 1] = ["v4.channel.k8s.io"];
pub const CHANNEL_PF_DATA: u8 = 0;
pub const CHANNEL_PF_ERROR: u8 = 1;

/// The subprotocols a streamed subresource speaks.
pub fn protocols_of(subresource: &str) -> &'static [&'static str] {
    if subresource == SUBRESOURCE_PORTFORWARD {
        &PORTFORWARD_PROTOCOLS
    } else {
        &EXEC_PROTOCOLS
    }
}

/// The first message on a port-forward channel: the channel byte, then the port.
pub fn port_prefix(channel: u8, port: u16) -> [u8; 3] {
    let [lo, hi] = port.to_le_bytes();
    [channel, lo, hi]
}

/// The one port a port-forward request names (`ports=P`): 1-65535, exactly one.
pub fn forwarded_port(values: &[String]) -> Result<u16, String> {
    let ports: Vec<&str> = values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    match ports[..] {
        [one] => match one.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(format!("ports: {one:?} is not a port (1-65535)")),
        },
        [] => Err("ports: name the port to forward to (ports=8080)".into()),
        _ => Err(format!(
            "ports: one port per connection, not {} ({})",
            ports.len(),
            ports.join(",")
        )),
    }
}

/// The path of a subresource below an API prefix (`/apis/<group>/<version>` for the
/// aggregated API, `/v1` on the agent).
pub fn subresource_path(prefix: &str, namespace: &str, name: &str, sub: &str) -> String {
    format!("{prefix}/namespaces/{namespace}/sandboxes/{name}/{sub}")
}

/// The final status of an exec, as `pods/exec` sends it on the status channel.
pub fn exit_status(code: i32) -> Value {
    if code == 0 {
        return json!({"metadata": {}, "status": "Success"});
    }
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("command terminated with non-zero exit code: {code}"),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
    })
}

/// A failure to run the command at all (no exit code), on the status channel.
pub fn exec_failure(message: &str) -> Value {
    json!({"metadata": {}, "status": "Failure", "message": message, "reason": "InternalError"})
}

/// What an exec status says: `Ok(code)` for a command that ran, `Err(message)` for one
/// that could not run.
pub fn exit_code(status: &Value) -> Result<i32, String> {
    if status["status"] == "Success" {
        return Ok(0);
    }
    let code = status["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["reason"] == "ExitCode")
        .and_then(|c| c["message"].as_str())
        .and_then(|m| m.parse().ok());
    match code {
        Some(c) => Ok(c),
        None => Err(status["message"]
            .as_str()
            .unwrap_or("exec failed without a message")
            .to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_round_trip_through_the_status() {
        for code in [0, 1, 3, 127, 255] {
            assert_eq!(exit_code(&exit_status(code)), Ok(code));
        }
        assert_eq!(
            exit_code(&exec_failure("no sandbox default/x on this node")),
            Err("no sandbox default/x on this node".to_string())
        );
    }

    #[test]
    fn a_port_forward_names_one_port() {
        assert_eq!(forwarded_port(&["8080".into()]), Ok(8080));
        assert_eq!(forwarded_port(&[" 22 ".into()]), Ok(22));
        for bad in [
            vec![],
            vec!["0".into()],
            vec!["65536".into()],
            vec!["http".into()],
        ] {
            assert!(forwarded_port(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            forwarded_port(&["80,443".into()]),
            Err("ports: one port per connection, not 2 (80,443)".into())
        );
        assert_eq!(port_prefix(CHANNEL_PF_ERROR, 8080), [1, 0x90, 0x1f]);
    }

    #[test]
    fn paths_name_namespace_sandbox_and_subresource() {
        assert_eq!(
            subresource_path("/apis/subresources.ramify.dev/v1alpha1", "a", "w", "exec"),
            "/apis/subresources.ramify.dev/v1alpha1/namespaces/a/sandboxes/w/exec"
        );
    }
}
