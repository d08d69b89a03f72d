//! How a restore brings a sandbox's memory back (`ramify-node-agent run
//! --restore-pages`), decided once at start-up from what the runsc can do.
//!
//! Lazy restores make a branch cost only the memory it touches: a branch that reads a
//! little of a large workspace stays small, so more branches and warm pools fit on a
//! node. The image must then stay unmodified while a branch runs from it, which holds
//! here: every checkpoint writes a new image directory, and runsc keeps the pages file
//! open, so removing an image only defers freeing its disk space until the last lazy
//! branch of it ends.

use crate::error::{Error, Result};
use crate::runsc::RunscCaps;

/// How `runsc restore` loads a sandbox's memory pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestorePages {
    /// Decided at start-up: the first of lazy, background, eager this runsc can do.
    #[default]
    Auto,
    /// `restore --lazy-pages`: a page is read from the image the first time the
    /// sandbox touches it; pages never touched are never loaded.
    Lazy,
    /// `restore --background`: the restore returns early and every page is loaded
    /// behind it.
    Background,
    /// Neither flag: the restore returns once every page is loaded.
    Eager,
}

impl RestorePages {
    pub fn as_str(self) -> &'static str {
        match self {
            RestorePages::Auto => "auto",
            RestorePages::Lazy => "lazy",
            RestorePages::Background => "background",
            RestorePages::Eager => "eager",
        }
    }

    /// The mode this runsc restores with when `self` is asked for (never `Auto`), or
    /// why it cannot: an explicit mode the runsc lacks refuses, so an agent never runs
    /// in another mode than the one it was told.
    pub fn resolve(self, caps: &RunscCaps) -> Result<RestorePages> {
        // Both flags need uncompressed images, which are only written when the
        // checkpoint has --compression (then it gets --compression=none); older
        // releases compress unconditionally.
        let lazy = caps.lazy_pages && caps.compression;
        let background = caps.background && caps.compression;
        match self {
            RestorePages::Auto if lazy => Ok(RestorePages::Lazy),
            RestorePages::Auto if background => Ok(RestorePages::Background),
            RestorePages::Auto | RestorePages::Eager => Ok(RestorePages::Eager),
            RestorePages::Lazy if lazy => Ok(RestorePages::Lazy),
            RestorePages::Background if background => Ok(RestorePages::Background),
            asked => Err(Error::Unsupported {
                version: caps.version.clone(),
                what: format!(
                    "--restore-pages={} needs `runsc restore --{}` and `runsc checkpoint \
                     --compression` (uncompressed images); use --restore-pages=auto, or a \
                     runsc that has them (hack/runsc/build.sh builds one with --lazy-pages)",
                    asked.as_str(),
                    if asked == RestorePages::Lazy {
                        "lazy-pages"
                    } else {
                        "background"
                    },
                ),
            }),
        }
    }

    /// The `runsc restore` flag of a resolved mode.
    pub(crate) fn restore_flag(self) -> Option<&'static str> {
        match self {
            // --lazy-pages implies --background.
            RestorePages::Lazy => Some("--lazy-pages"),
            RestorePages::Background => Some("--background"),
            RestorePages::Auto | RestorePages::Eager => None,
        }
    }
}

impl std::fmt::Display for RestorePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RestorePages {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(RestorePages::Auto),
            "lazy" => Ok(RestorePages::Lazy),
            "background" => Ok(RestorePages::Background),
            "eager" => Ok(RestorePages::Eager),
            other => Err(Error::Invalid(format!(
                "unknown restore pages mode {other:?}: auto, lazy, background or eager"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RestorePages::{self, *};
    use crate::runsc::{OverlayFlag, RunscCaps};

    fn caps(lazy_pages: bool, background: bool, compression: bool) -> RunscCaps {
        RunscCaps {
            version: "runsc version test".into(),
            release_date: None,
            leave_running: false,
            leave_running_flag: false,
            background,
            lazy_pages,
            compression,
            overlay: OverlayFlag::Overlay2Root,
            hide_proc_sys_net: false,
        }
    }

    #[test]
    fn auto_takes_the_best_the_runsc_has() {
        assert_eq!(Auto.resolve(&caps(true, true, true)).ok(), Some(Lazy));
        assert_eq!(
            Auto.resolve(&caps(false, true, true)).ok(),
            Some(Background)
        );
        // Debian's 2022 runsc: no flag at all.
        assert_eq!(Auto.resolve(&caps(false, false, false)).ok(), Some(Eager));
        // Compressed images cannot be loaded lazily nor in the background.
        assert_eq!(Auto.resolve(&caps(true, true, false)).ok(), Some(Eager));
    }

    #[test]
    fn an_explicit_mode_the_runsc_lacks_refuses_saying_what_is_missing() {
        let e = Lazy
            .resolve(&caps(false, true, true))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("--restore-pages=lazy") && e.contains("restore --lazy-pages"),
            "{e}"
        );
        assert!(Background.resolve(&caps(false, false, false)).is_err());
        assert_eq!(Eager.resolve(&caps(true, true, true)).ok(), Some(Eager));
        assert_eq!(
            Background.resolve(&caps(true, true, true)).ok(),
            Some(Background)
        );
    }

    #[test]
    fn parses_and_names_every_mode() {
        for m in [Auto, Lazy, Background, Eager] {
            assert_eq!(m.as_str().parse::<RestorePages>().ok(), Some(m));
        }
        assert!("fast".parse::<RestorePages>().is_err());
        assert_eq!(Lazy.restore_flag(), Some("--lazy-pages"));
        assert_eq!(Eager.restore_flag(), None);
    }
}
