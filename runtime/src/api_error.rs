//! What a 404 from the API server means. An object that does not exist is answered
//! with a `NotFound` Status naming it; a path the server does not serve is answered
//! `404 page not found` (not a Status). A kube-apiserver that has just started
//! answers the latter for every custom resource until it has loaded their
//! definitions: that 404 is transient, and taking it for "the object is gone" left a
//! BranchSet waiting forever on a change that never came (a permanent error) or
//! counted a live branch as vanished.

/// Whether `err` says the object does not exist (the API server's `NotFound` Status).
pub fn is_object_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 404 && s.reason == "NotFound")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(status: Status) -> kube::Error {
        kube::Error::Api(status.boxed())
    }

    #[test]
    fn an_object_not_found_is_told_from_a_path_not_served() {
        // What kube-client builds from each answer (a Status, or plain text).
        let gone =
            api(Status::failure("sandboxes.ramify.dev \"x\" not found", "NotFound").with_code(404));
        let unserved =
            api(Status::failure("404 page not found", "Failed to parse error data").with_code(404));
        assert!(is_object_not_found(&gone));
        assert!(!is_object_not_found(&unserved));
        let conflict = api(Status::failure("conflict", "Conflict").with_code(409));
        assert!(!is_object_not_found(&conflict));
    }
}
