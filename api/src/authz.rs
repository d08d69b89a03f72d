//! May this user do this? Asked of the API server's own authorizer (RBAC, webhooks,
//! whatever the cluster runs) with a SubjectAccessReview per call, on the
//! subresource in the sandbox's namespace, as kubelet and KubeVirt's virt-api do.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;
use ramify_crds::subresources::SUBRESOURCE_GROUP;

use crate::authn::User;

/// What is asked: `verb` on `sandboxes/<subresource>` of `name` in `namespace`.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub verb: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    pub subresource: &'a str,
}

/// The decision: `Err(message)` names the user, the verb and the resource the way the
/// API server's own Forbidden errors do.
pub async fn check(
    client: &kube::Client,
    user: &User,
    req: &Request<'_>,
) -> Result<Result<(), String>, kube::Error> {
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: user.uid.clone(),
            groups: Some(user.groups.clone()),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                group: Some(SUBRESOURCE_GROUP.into()),
                resource: Some("sandboxes".into()),
                subresource: Some(req.subresource.into()),
                verb: Some(req.verb.into()),
                namespace: Some(req.namespace.into()),
                name: Some(req.name.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = api.create(&PostParams::default(), &review).await?;
    let status = answer.status.unwrap_or_default();
    if status.allowed && !status.denied.unwrap_or(false) {
        return Ok(Ok(()));
    }
    let why = status
        .reason
        .filter(|r| !r.is_empty())
        .map(|r| format!(": {r}"))
        .unwrap_or_default();
    Ok(Err(format!(
        "sandboxes.{SUBRESOURCE_GROUP} \"{}\" is forbidden: User \"{}\" cannot {} resource \"sandboxes/{}\" in API group \"{SUBRESOURCE_GROUP}\" in the namespace \"{}\"{why}",
        req.name, user.name, req.verb, req.subresource, req.namespace
    )))
}
