//! What a destination's settings give the rest of the relay.
//!
//! Each destination owns its TOML section (`[sns]`, `[sqs]`, …): the struct,
//! its defaults, its validation and its routing rules live in the
//! destination's folder; the configuration tree only holds the section, and
//! [`crate::config::Config::destination`] picks the one `[sink] kind` names.

use std::sync::Arc;

pub(crate) use super::allow::Allowed;

/// A destination's settings section.
pub trait Settings {
    /// Report every problem with the section's values to `bad`, each under
    /// its key (`sns.topic_arn`) with what to do.
    fn validate(&self, bad: &mut dyn FnMut(&str, String));

    /// How events find their destination (topic, queue, bus, stream, URL).
    fn routes(&self) -> Routes;

    /// Whether `name` (`poller.dead_letter_topic`) is a destination that can
    /// take notices of dead rows, or why not.
    fn dead_letter(&self, name: &str) -> Result<(), String>;

    /// The section's keys whose values are secrets (taken verbatim from the
    /// environment, never parsed or printed).
    fn secrets(&self) -> &'static [&'static str] {
        &[]
    }

    /// The key that widens what rows and templates may name
    /// (`sns.allowed_destinations`), for `check`; `None` where data names
    /// nothing (one destination).
    fn allowed_key(&self) -> Option<&'static str> {
        None
    }
}

/// A destination's sink cannot be built from its settings (or the
/// environment variables it reads).
#[derive(Debug, thiserror::Error)]
#[error("{key}: {message}")]
pub struct SetupError {
    /// The configuration key (or environment variable).
    pub key: &'static str,
    /// What to do.
    pub message: String,
}

/// A destination's routing rules.
#[derive(Clone)]
pub struct Routes {
    /// Where an event goes when nothing else names a destination.
    pub default: Option<String>,
    /// Destination per event: `{aggregate_type}`, `{event_type}` and the
    /// [`variables`](Self::variables) are replaced.
    pub template: Option<String>,
    /// The sink's own template variables (name without braces, value).
    pub variables: Vec<(&'static str, String)>,
    /// The full name of a destination a row names (bare or full).
    pub expand: Arc<dyn Fn(&str) -> String + Send + Sync>,
    /// Why an event has no destination (nothing above names one).
    pub missing: String,
    /// What a row or a rendered template may name ([`Allowed`]); the
    /// default destination is the configuration's own and is not checked.
    pub allowed: Allowed,
    /// How a row's value is written into the template (URL templates
    /// percent-encode it), or why it cannot be.
    pub escape: fn(&str) -> Result<String, String>,
}

/// A template value as it is (AWS names: the allow-list keeps a value from
/// reaching another account or region).
pub(crate) fn verbatim(value: &str) -> Result<String, String> {
    Ok(value.to_owned())
}

impl Routes {
    /// Everything to one unnamed destination (single-destination sinks).
    pub fn single() -> Self {
        Self {
            default: Some(String::new()),
            template: None,
            variables: Vec::new(),
            expand: Arc::new(|_| String::new()),
            missing: String::new(),
            allowed: Allowed::patterns([String::new()]),
            escape: verbatim,
        }
    }
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("default", &self.default)
            .field("template", &self.template)
            .field("variables", &self.variables)
            .field("allowed", &self.allowed)
            .finish_non_exhaustive()
    }
}

/// The settings of a sink with no keys and one unnamed destination (stdout).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unnamed {}

impl Settings for Unnamed {
    fn validate(&self, _: &mut dyn FnMut(&str, String)) {}

    fn routes(&self) -> Routes {
        Routes::single()
    }

    fn dead_letter(&self, _: &str) -> Result<(), String> {
        Err("the stdout sink has no destinations to name: a dead-letter destination needs another [sink] kind".into())
    }
}

/// Check a destination template: braces closed, only `{aggregate_type}`,
/// `{event_type}` and `variables` used. Each problem goes to `bad` under `key`.
pub(crate) fn check_template(
    key: &str,
    template: &str,
    variables: &[&str],
    bad: &mut dyn FnMut(&str, String),
) {
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            bad(key, "a `{` is not closed".into());
            return;
        };
        let name = &rest[open + 1..open + close];
        if !(["aggregate_type", "event_type"].contains(&name) || variables.contains(&name)) {
            let mut known = vec!["{aggregate_type}".to_owned(), "{event_type}".to_owned()];
            known.extend(variables.iter().map(|v| format!("{{{v}}}")));
            bad(
                key,
                format!("unknown placeholder {{{name}}}: use {}", known.join(", ")),
            );
        }
        rest = &rest[open + close + 1..];
    }
}
