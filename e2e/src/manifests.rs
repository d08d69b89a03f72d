//! Manifests more than one test applies, in both modes.

/// BranchSet `inner`, nested under the branch `outer-explore`: `left` writes `left` to
/// `file` and exits 0 (it wins), `right` writes `right` and exits 1.
pub fn nested_inner_branchset(file: &str, timeout_seconds: u32) -> String {
    format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: inner
spec:
  source: {{sandbox: outer-explore}}
  branches:
    - name: left
      run: ["/bin/sh", "-c", "echo left > {file}"]
    - name: right
      run: ["/bin/sh", "-c", "echo right > {file}; exit 1"]
  timeoutSeconds: {timeout_seconds}
"#
    )
}
