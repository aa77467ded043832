//! The call settings of every AWS destination's section, declared once:
//! where its calls go (`region`, `endpoint_url`) and how they are made
//! (`max_in_flight_batches`, `concurrency`, `linger`, `operation_timeout`,
//! `attempt_timeout`, `retry_unknown_errors_for`), with their defaults and
//! their checks.
//!
//! A section is written with [`section!`], which puts these fields among the
//! section's own. They are not a struct of their own flattened in
//! (`#[serde(flatten)]`, as Vector's `BaseSSSinkConfig`), because a
//! flattened section would
//! * refuse an unknown key without listing the keys it expected (serde's
//!   `deny_unknown_fields` then sees only the keys nobody took),
//! * hide the shared keys from [`crate::config::value::field_names`], which
//!   the key list (`config::keys`) and the docs drift tests read, and
//! * lose a service's own defaults (`[kinesis]` keeps fewer calls in flight)
//!   under the section's `#[serde(default)]`.
//!
//! [`named_routes`] is the routing of the sections whose destinations a row
//! names by a name or an ARN (`[eventbridge]`, `[kinesis]`).

use std::sync::Arc;
use std::time::Duration;

use crate::config::allow;
use crate::config::settings::{verbatim, Routes};

/// Default `linger`: how long a partial batch waits for more messages.
pub(crate) const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// Default `operation_timeout`.
pub(crate) const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `attempt_timeout`.
pub(crate) const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `retry_unknown_errors_for`.
pub(crate) const DEFAULT_RETRY_UNKNOWN_ERRORS_FOR: Duration = Duration::from_secs(600);

/// An AWS destination's settings section: a struct refusing unknown keys,
/// whose missing keys take their defaults, with its `Default`,
/// `concurrency()` and `check_calls()`.
///
/// ```ignore
/// section! {
///     /// `[sqs]`: the SQS sink.
///     pub struct SqsConfig in "sqs" {
///         /// AWS region; empty: the queue URL's, else the standard AWS chain.
///         region, endpoint_url,
///         /// The default queue's URL.
///         pub queue_url: String = String::new(),
///         calls { max_in_flight_batches: DEFAULT_SQS_IN_FLIGHT_BATCHES },
///         /// …
///         pub allowed_destinations: Vec<String> = Vec::new(),
///     }
/// }
/// ```
///
/// `region, endpoint_url` stand first (with the region's doc, which says
/// where the section reads a region when it is not set); each of the
/// section's own keys is `pub name: Type = default,`; `calls { … }` puts
/// `max_in_flight_batches` (with the service's default), `concurrency`,
/// `linger`, `operation_timeout`, `attempt_timeout` and
/// `retry_unknown_errors_for` at its place. The keys keep the order written:
/// serde lists them in it when it refuses an unknown key, so the order is
/// one users see.
macro_rules! section {
    (
        $(#[$attr:meta])*
        pub struct $name:ident in $section:literal {
            $(#[$region_doc:meta])*
            region, endpoint_url,
            $($(#[$head_attr:meta])* pub $head:ident: $head_ty:ty = $head_default:expr,)*
            calls { max_in_flight_batches: $in_flight:expr },
            $($(#[$tail_attr:meta])* pub $tail:ident: $tail_ty:ty = $tail_default:expr,)*
        }
    ) => {
        $(#[$attr])*
        #[derive(Debug, Clone, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct $name {
            $(#[$region_doc])*
            pub region: String,
            /// Endpoint override for local or compatible endpoints, e.g.
            /// `http://127.0.0.1:5000`; empty: the SDK's order of settings.
            pub endpoint_url: String,
            $($(#[$head_attr])* pub $head: $head_ty,)*
            /// The most batch calls in flight at once.
            pub max_in_flight_batches: usize,
            /// How many calls are in flight: adaptive (up to
            /// `max_in_flight_batches`) or a fixed number.
            pub concurrency: $crate::pipeline::concurrency::ConcurrencyMode,
            /// How long a partial batch waits for more messages.
            #[serde(deserialize_with = "crate::config::value::de_duration")]
            pub linger: std::time::Duration,
            /// Ceiling of one call, retries included.
            #[serde(deserialize_with = "crate::config::value::de_duration")]
            pub operation_timeout: std::time::Duration,
            /// Ceiling of one attempt of a call.
            #[serde(deserialize_with = "crate::config::value::de_duration")]
            pub attempt_timeout: std::time::Duration,
            /// How long an event failing for a reason the service does not
            /// make known as passing or permanent is retried before it is
            /// recorded as failed.
            #[serde(deserialize_with = "crate::config::value::de_duration")]
            pub retry_unknown_errors_for: std::time::Duration,
            $($(#[$tail_attr])* pub $tail: $tail_ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                use $crate::sink::aws::settings as calls;
                Self {
                    region: String::new(),
                    endpoint_url: String::new(),
                    $($head: $head_default,)*
                    max_in_flight_batches: $in_flight,
                    concurrency: $crate::pipeline::concurrency::ConcurrencyMode::Adaptive,
                    linger: calls::DEFAULT_LINGER,
                    operation_timeout: calls::DEFAULT_OPERATION_TIMEOUT,
                    attempt_timeout: calls::DEFAULT_ATTEMPT_TIMEOUT,
                    retry_unknown_errors_for: calls::DEFAULT_RETRY_UNKNOWN_ERRORS_FOR,
                    $($tail: $tail_default,)*
                }
            }
        }

        impl $name {
            /// The publisher's concurrency for this sink.
            pub fn concurrency(&self) -> $crate::pipeline::concurrency::Concurrency {
                self.concurrency.with_ceiling(self.max_in_flight_batches)
            }

            /// Report every problem with the call settings to `bad`, each
            /// under its key ([`check_calls`](crate::sink::aws::settings::check_calls)).
            fn check_calls(&self, bad: &mut dyn FnMut(&str, String)) {
                self.concurrency.validate(
                    $section,
                    ("max_in_flight_batches", self.max_in_flight_batches),
                    bad,
                );
                $crate::sink::aws::settings::check_calls(
                    $section,
                    &self.endpoint_url,
                    (self.operation_timeout, self.attempt_timeout),
                    self.linger,
                    bad,
                );
            }
        }
    };
}

pub(crate) use section;

/// Check the call settings every AWS batch destination has, each problem
/// under `section.key`: both timeouts above zero and an attempt no longer
/// than its call, a linger of at most a second, an HTTP(S) endpoint.
pub(crate) fn check_calls(
    section: &str,
    endpoint_url: &str,
    (operation_timeout, attempt_timeout): (Duration, Duration),
    linger: Duration,
    bad: &mut dyn FnMut(&str, String),
) {
    if operation_timeout.is_zero() || attempt_timeout.is_zero() {
        bad(
            &format!("{section}.operation_timeout"),
            format!("{section}.operation_timeout and {section}.attempt_timeout must be greater than zero"),
        );
    }
    if attempt_timeout > operation_timeout {
        bad(
            &format!("{section}.attempt_timeout"),
            format!("must not be longer than {section}.operation_timeout"),
        );
    }
    if linger > Duration::from_secs(1) {
        bad(&format!("{section}.linger"), "must be at most 1s".into());
    }
    if let Err(message) = crate::config::value::check_endpoint_url(endpoint_url) {
        bad(&format!("{section}.endpoint_url"), message);
    }
}

/// The routes of a destination a row names by a name or an ARN (an event
/// bus, a stream), sent as named: any bare name (it is the relay's own
/// account and region's), ARNs in the partition, region and account of
/// `default`, and the patterns of `allowed_destinations`.
pub(crate) fn named_routes(
    default: &str,
    allowed_destinations: &[String],
    missing: &str,
) -> Routes {
    Routes {
        default: (!default.is_empty()).then(|| default.to_owned()),
        template: None,
        variables: Vec::new(),
        expand: Arc::new(str::to_owned),
        allowed: allow::aws(
            [Some("*".to_owned()), allow::same_account(default)],
            allowed_destinations,
        ),
        escape: verbatim,
        missing: missing.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::tests::{load, problems, MINIMAL};
    use crate::config::Config;
    use crate::pipeline::concurrency::Concurrency;

    /// Every AWS section, a destination it accepts, and its default ceiling
    /// of calls in flight.
    const SECTIONS: [(&str, &str, usize); 4] = [
        (
            "sns",
            "topic_arn = \"arn:aws:sns:eu-west-1:123456789012:t\"",
            500,
        ),
        (
            "sqs",
            "queue_url = \"https://sqs.eu-west-1.amazonaws.com/123456789012/q\"",
            500,
        ),
        ("eventbridge", "bus = \"default\"", 500),
        ("kinesis", "stream = \"orders\"", 200),
    ];

    type Calls = (String, String, Concurrency, [Duration; 4]);

    /// The call settings of section `name` as loaded.
    fn calls(config: &Config, name: &str) -> Calls {
        macro_rules! of {
            ($s:expr) => {
                (
                    $s.region.clone(),
                    $s.endpoint_url.clone(),
                    $s.concurrency(),
                    [
                        $s.linger,
                        $s.operation_timeout,
                        $s.attempt_timeout,
                        $s.retry_unknown_errors_for,
                    ],
                )
            };
        }
        let d = &config.destinations;
        match name {
            "sns" => of!(d.sns),
            "sqs" => of!(d.sqs),
            "eventbridge" => of!(d.eventbridge),
            "kinesis" => of!(d.kinesis),
            other => panic!("{other} is not an AWS section"),
        }
    }

    fn text(name: &str, destination: &str, extra: &str) -> String {
        format!("{MINIMAL}[sink]\nkind = \"{name}\"\n[{name}]\n{destination}\n{extra}")
    }

    #[test]
    fn every_aws_section_takes_the_call_settings_from_its_defaults_the_file_and_the_environment() {
        for (name, destination, ceiling) in SECTIONS {
            let c = load(&text(name, destination, ""), &[]).unwrap();
            let defaults = [5, 10_000, 5_000, 600_000].map(Duration::from_millis);
            let expected = (
                String::new(),
                String::new(),
                Concurrency::Adaptive { ceiling },
                defaults,
            );
            assert_eq!(calls(&c, name), expected, "[{name}] defaults");

            let set = "region = \"eu-west-1\"\nendpoint_url = \"http://127.0.0.1:4566\"\n\
                       max_in_flight_batches = 64\nlinger = \"20ms\"\noperation_timeout = \"30s\"\n\
                       attempt_timeout = \"3s\"\nretry_unknown_errors_for = \"1m\"\n";
            let c = load(&text(name, destination, set), &[]).unwrap();
            let durations = [20, 30_000, 3_000, 60_000].map(Duration::from_millis);
            let expected = (
                "eu-west-1".to_owned(),
                "http://127.0.0.1:4566".to_owned(),
                Concurrency::Adaptive { ceiling: 64 },
                durations,
            );
            assert_eq!(calls(&c, name), expected, "[{name}] from the file");

            let section = name.to_uppercase();
            let env: Vec<(String, &str)> = [
                ("REGION", "eu-west-1"),
                ("ENDPOINT_URL", "http://127.0.0.1:4566"),
                ("MAX_IN_FLIGHT_BATCHES", "64"),
                ("CONCURRENCY", "8"),
                ("LINGER", "20ms"),
                ("OPERATION_TIMEOUT", "30s"),
                ("ATTEMPT_TIMEOUT", "3s"),
                ("RETRY_UNKNOWN_ERRORS_FOR", "1m"),
            ]
            .into_iter()
            .map(|(key, value)| (format!("OUTBOX_RELAY__{section}__{key}"), value))
            .collect();
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            let c = load(&text(name, destination, ""), &env).unwrap();
            let expected = (expected.0, expected.1, Concurrency::Fixed(8), durations);
            assert_eq!(calls(&c, name), expected, "[{name}] from the environment");
        }
    }

    #[test]
    fn every_aws_section_refuses_unknown_keys_and_names_each_bad_call_setting() {
        for (name, destination, _) in SECTIONS {
            let p = problems(load(&text(name, destination, "regoin = \"x\""), &[]).unwrap_err());
            assert_eq!(p.len(), 1, "{p:?}");
            assert_eq!(p[0].key, format!("{name}.regoin"));
            let shared = "`max_in_flight_batches`, `concurrency`, `linger`, `operation_timeout`, \
                          `attempt_timeout`, `retry_unknown_errors_for`";
            for listed in ["expected one of `region`, `endpoint_url`, ", shared] {
                assert!(p[0].message.contains(listed), "{listed}: {p:?}");
            }

            let bad = "endpoint_url = \"localhost:4566\"\nconcurrency = 0\nlinger = \"2s\"\n\
                       operation_timeout = \"0s\"\nattempt_timeout = \"1s\"\n";
            let p = problems(load(&text(name, destination, bad), &[]).unwrap_err());
            let p: Vec<(&str, &str)> = p
                .iter()
                .map(|p| (p.key.as_str(), p.message.as_str()))
                .collect();
            let concurrency = format!(
                "0 must be between 1 and {name}.max_in_flight_batches ({}), or \"adaptive\"",
                SECTIONS.iter().find(|s| s.0 == name).unwrap().2
            );
            let zero = format!(
                "{name}.operation_timeout and {name}.attempt_timeout must be greater than zero"
            );
            let longer = format!("must not be longer than {name}.operation_timeout");
            let expected = [
                (format!("{name}.concurrency"), concurrency),
                (format!("{name}.operation_timeout"), zero),
                (format!("{name}.attempt_timeout"), longer),
                (format!("{name}.linger"), "must be at most 1s".to_owned()),
                (
                    format!("{name}.endpoint_url"),
                    "\"localhost:4566\" must start with http:// or https://".to_owned(),
                ),
            ];
            let expected: Vec<(&str, &str)> = expected
                .iter()
                .map(|(k, m)| (k.as_str(), m.as_str()))
                .collect();
            assert_eq!(p, expected, "[{name}]");
        }
    }
}
