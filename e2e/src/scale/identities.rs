//! The scale run's users: a kubeconfig each, `cluster-admin` for their group, and a
//! FlowSchema each, so the API server counts their requests apart.

use super::*;

/// The run's users: a kubeconfig each, `cluster-admin` for their group, and a
/// FlowSchema each so the API server counts their requests apart.
pub(super) struct Identities {
    pub(super) operator: PathBuf,
    pub(super) agents: PathBuf,
    pub(super) driver: PathBuf,
}

impl Identities {
    pub(super) async fn make(cp: &ControlPlane, base: &Path) -> Result<Identities, ScaleError> {
        let dir = base.join("users");
        let ids = Identities {
            operator: cp.user_kubeconfig(USER_OPERATOR, &[GROUP], &dir),
            agents: cp.user_kubeconfig(USER_SIMULATED_AGENTS, &[GROUP], &dir),
            driver: cp.user_kubeconfig(USER_DRIVER, &[GROUP], &dir),
        };
        let mut yaml = format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: {GROUP}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}}\nsubjects:\n- {{apiGroup: rbac.authorization.k8s.io, kind: Group, name: {GROUP}}}\n"
        );
        for user in [USER_OPERATOR, USER_SIMULATED_AGENTS, USER_DRIVER] {
            yaml.push_str(&format!(
                r#"---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: {user}}}
spec:
  priorityLevelConfiguration: {{name: exempt}}
  matchingPrecedence: 50
  rules:
  - subjects: [{{kind: User, user: {{name: {user}}}}}]
    resourceRules: [{{verbs: ["*"], apiGroups: ["*"], resources: ["*"], clusterScope: true, namespaces: ["*"]}}]
    nonResourceRules: [{{verbs: ["*"], nonResourceURLs: ["*"]}}]
"#
            ));
        }
        let out = cp
            .kubectl_run(&["apply", "-f", "-"], Some(&yaml))
            .map_err(io_err("kubectl apply (users)"))?;
        if !out.success {
            return Err(ScaleError::Check(format!(
                "applying the run's RBAC and FlowSchemas: {}",
                out.stderr
            )));
        }
        // Counted apart only once the API server's flow control has taken them in.
        let deadline = Instant::now() + Duration::from_secs(30);
        for user in [USER_OPERATOR, USER_SIMULATED_AGENTS, USER_DRIVER] {
            loop {
                let out = cp
                    .kubectl_run(
                        &[
                            "get",
                            "flowschema",
                            user,
                            "-o",
                            r#"jsonpath={.status.conditions[?(@.type=="Dangling")].status}"#,
                        ],
                        None,
                    )
                    .map_err(io_err("kubectl get flowschema"))?;
                if out.stdout.trim() == "False" {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(ScaleError::Timeout(
                        Duration::from_secs(30),
                        format!("FlowSchema {user} taken in"),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(ids)
    }

    /// Removes the cluster-wide objects (best effort: a test control plane).
    pub(super) fn remove(&self, cp: &ControlPlane) {
        let _ = cp.kubectl_run(
            &[
                "delete",
                "--ignore-not-found",
                "--wait=false",
                &format!("clusterrolebinding/{GROUP}"),
                &format!("flowschema/{USER_OPERATOR}"),
                &format!("flowschema/{USER_SIMULATED_AGENTS}"),
                &format!("flowschema/{USER_DRIVER}"),
            ],
            None,
        );
    }
}
