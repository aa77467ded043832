//! What a destination's settings give the rest of the relay.
//!
//! Each destination owns its TOML section (`[sns]`, `[sqs]`, …): the struct,
//! its defaults, its validation and its routing rules live in the
//! destination's folder; the configuration tree only holds the section, and
//! [`crate::config::Config::destination`] picks the one `[sink] kind` names.

use crate::route::Routes;

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
}
