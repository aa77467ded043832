//! The destinations: one module each, and the registry that builds the one
//! `[sink] kind` names.
//!
//! Each destination implements the contract of [`crate::pipeline::sink`]
//! and owns its settings section ([`crate::config::settings::Settings`]).
//! The AWS destinations share [`aws`]: the signed client, the error table
//! and the batch loop. Every destination that speaks HTTP goes out through
//! [`http`], the relay's plain-HTTP egress.

use std::time::Duration;

use crate::config::settings::{Settings, SetupError, Unnamed};
use crate::pipeline::sink::{Concurrency, Message, Outcome, Sink, Source};

pub(crate) mod aws;
mod http;
mod unknown;

pub(crate) use sns::{SnsConfig, SnsSink};
pub(crate) use stdout::StdoutSink;
pub(crate) use webhook::{WebhookConfig, WebhookSink};

/// Every destination, one line each:
/// `name: Variant(SinkType, SettingsType) = |section| expression making the sink`.
/// `name` is the `[sink] kind` value, the name of the settings' TOML
/// section and of the destination's module (`sink/<name>/` or
/// `sink/<name>.rs`); `Variant` is `name` capitalised (serde matches it
/// lower-cased).
/// From the list come [`Kind`], the sections' struct [`Sections`] (which
/// [`crate::config::Config`] holds), and [`Configured`], the sink behind one
/// type so callers need one code path. Adding a destination is one line here.
/// The line's `///` comes before the module's own `//!` docs, so rustdoc
/// resolves all of them from this module: links in a destination's module
/// docs spell full paths (`crate::sink::sns::Topics`) and cannot reach its
/// private items.
macro_rules! destinations {
    ($($(#[$doc:meta])* $name:ident: $variant:ident($sink:ty, $settings:ty) = |$section:ident| $build:expr;)+) => {
        $($(#[$doc])* pub(crate) mod $name;)+

        /// The destinations `[sink] kind` can name.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Kind {
            $($(#[$doc])* $variant,)+
        }

        /// Every destination's settings section.
        #[derive(Debug, Clone, Default, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Sections {
            $($(#[$doc])* #[serde(default)] pub $name: $settings,)+
        }

        impl Sections {
            /// The sections' names (`sns`, `webhook`, …).
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name)),+];

            /// The settings of `kind`.
            pub fn get(&self, kind: Kind) -> &dyn Settings {
                match kind { $(Kind::$variant => &self.$name,)+ }
            }

            /// Every key of every section, `section.key`.
            pub fn keys() -> Vec<String> {
                let mut keys = Vec::new();
                $(keys.extend(
                    crate::config::value::field_names::<$settings>()
                        .iter()
                        .map(|f| format!("{}.{f}", stringify!($name))),
                );)+
                keys
            }

            /// The keys whose values are secrets, `section.key`.
            pub fn secret_keys() -> Vec<String> {
                let sections = Self::default();
                let mut keys = Vec::new();
                $(keys.extend(
                    Settings::secrets(&sections.$name)
                        .iter()
                        .map(|f| format!("{}.{f}", stringify!($name))),
                );)+
                keys
            }
        }

        /// The configured sink.
        pub(crate) enum Configured {
            $($(#[$doc])* $variant(Box<$sink>),)+
        }

        impl Configured {
            /// Build the sink `kind` names from its section of `sections`.
            pub(crate) async fn new(kind: Kind, sections: &Sections) -> Result<Self, SetupError> {
                Ok(match kind {
                    $(Kind::$variant => {
                        let $section = &sections.$name;
                        Self::$variant(Box::new($build))
                    })+
                })
            }
        }

        impl Sink for Configured {
            fn name(&self) -> &'static str {
                match self { $(Self::$variant(s) => s.name(),)+ }
            }

            fn max_batch(&self) -> usize {
                match self { $(Self::$variant(s) => s.max_batch(),)+ }
            }

            fn max_run(&self) -> usize {
                match self { $(Self::$variant(s) => s.max_run(),)+ }
            }

            fn concurrency(&self) -> Concurrency {
                match self { $(Self::$variant(s) => s.concurrency(),)+ }
            }

            fn linger(&self) -> Duration {
                match self { $(Self::$variant(s) => s.linger(),)+ }
            }

            fn source(&self, source: &Source) {
                match self { $(Self::$variant(s) => s.source(source),)+ }
            }

            async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
                // Boxed: a network sink's call state is kilobytes, and the
                // publisher moves each batch's future into a task of its own;
                // unboxed, every sink's future would be as large as the largest.
                match self { $(Self::$variant(s) => Box::pin(s.publish(batch)).await,)+ }
            }
        }
    };
}

// Not derived: `#[default]` would have to go through the macro's list.
#[allow(clippy::derivable_impls)]
impl Default for Kind {
    fn default() -> Self {
        Self::Stdout
    }
}

destinations! {
    /// One envelope per line on standard output.
    stdout: Stdout(StdoutSink, Unnamed) = |_section| StdoutSink::new();
    /// AWS SNS (`[sns]`).
    sns: Sns(SnsSink, SnsConfig) = |section| SnsSink::new(section).await?;
    /// HTTP POST signed as Standard Webhooks (`[webhook]`).
    webhook: Webhook(WebhookSink, WebhookConfig) = |section| WebhookSink::new(section)?;
    /// Amazon SQS (`[sqs]`).
    sqs: Sqs(sqs::SqsSink, sqs::SqsConfig) = |section| sqs::SqsSink::new(section).await?;
    /// Amazon EventBridge (`[eventbridge]`).
    eventbridge: EventBridge(eventbridge::EventBridgeSink, eventbridge::EventBridgeConfig) = |section| eventbridge::EventBridgeSink::new(section).await?;
    /// Amazon Kinesis Data Streams (`[kinesis]`).
    kinesis: Kinesis(kinesis::KinesisSink, kinesis::KinesisConfig) = |section| kinesis::KinesisSink::new(section).await?;
}
