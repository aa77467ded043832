//! `[kinesis]`: the Kinesis Data Streams sink's settings, their defaults and
//! their validation.

use crate::config::allow;
use crate::config::settings::{Routes, Settings};
use crate::sink::aws::settings::{named_routes, section};

/// Default ceiling of `PutRecords` calls in flight.
pub(crate) const DEFAULT_KINESIS_IN_FLIGHT_BATCHES: usize = 200;
/// A stream's record size limit unless raised (`MaxRecordSizeInKiB` 1024).
pub(crate) const DEFAULT_MAX_RECORD_SIZE: usize = 1 << 20;
/// The most a stream's record size limit can be raised to.
pub(crate) const MAX_RECORD_SIZE: usize = 10 << 20;

section! {
    /// `[kinesis]`: the Kinesis Data Streams sink.
    pub struct KinesisConfig in "kinesis" {
        /// AWS region; empty: the stream ARN's, else the standard AWS chain.
        region, endpoint_url,
        /// The default stream: a name or an ARN.
        pub stream: String = String::new(),
        /// The stream's largest record (data and partition key, in bytes): 1 MiB
        /// unless the stream's `MaxRecordSizeInKiB` was raised (up to 10 MiB).
        pub max_record_size: usize = DEFAULT_MAX_RECORD_SIZE,
        /// At most one record of each ordering group in a `PutRecords` call, so a
        /// record that fails (throttled by its shard) is never overtaken by a
        /// later one of its key. `false` sends runs of a group in one call:
        /// faster for few busy groups, but a failed record then arrives after
        /// later ones of its key.
        pub strict_order: bool = true,
        calls { max_in_flight_batches: DEFAULT_KINESIS_IN_FLIGHT_BATCHES },
        /// Streams a row's `topic` column may name besides bare names
        /// (the relay's own account and region) and ARNs of the configured
        /// stream's partition, region and account: ARN patterns, `*` standing for one name.
        pub allowed_destinations: Vec<String> = Vec::new(),
    }
}

impl KinesisConfig {
    /// The region of `region`, or of the stream ARN.
    pub fn region_or_arn(&self) -> Option<&str> {
        if !self.region.is_empty() {
            return Some(&self.region);
        }
        crate::sink::aws::arn_region(&self.stream)
    }
}

/// Whether `name` can name a stream: 1 to 128 of letters, digits and `_.-`,
/// or a stream ARN.
fn stream_name(name: &str) -> Result<(), String> {
    let arn = name.starts_with("arn:") && name.contains(":stream/");
    let plain = (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if arn || plain {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a stream name (1 to 128 letters, digits, . - _) or ARN (arn:aws:kinesis:<region>:<account>:stream/<name>)"
        ))
    }
}

impl Settings for KinesisConfig {
    fn allowed_key(&self) -> Option<&'static str> {
        Some("kinesis.allowed_destinations")
    }

    fn validate(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.stream.is_empty() {
            bad(
                "kinesis.stream",
                "missing: set kinesis.stream, the stream name or ARN".into(),
            );
        } else if let Err(message) = stream_name(&self.stream) {
            bad("kinesis.stream", message);
        }
        if !(1024..=MAX_RECORD_SIZE).contains(&self.max_record_size) {
            bad(
                "kinesis.max_record_size",
                format!("must be from 1024 to {MAX_RECORD_SIZE} bytes (the stream's MaxRecordSizeInKiB)"),
            );
        }
        allow::check_patterns(
            "kinesis.allowed_destinations",
            &self.allowed_destinations,
            bad,
        );
        self.check_calls(bad);
    }

    fn routes(&self) -> Routes {
        named_routes(
            &self.stream,
            &self.allowed_destinations,
            "no stream: the row names none and kinesis.stream is not set",
        )
    }

    fn dead_letter(&self, name: &str) -> Result<(), String> {
        stream_name(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{load, problems, MINIMAL};

    #[test]
    fn the_kinesis_sink_needs_a_stream_and_names_each_bad_key() {
        let k = |extra: &str| format!("{MINIMAL}\n[sink]\nkind = \"kinesis\"\n[kinesis]\n{extra}");
        let p = problems(load(&k(""), &[]).unwrap_err());
        assert!(p.iter().any(|p| p.key == "kinesis.stream"), "{p:?}");
        let p =
            problems(load(&k("stream = \"a b\"\nmax_record_size = 20000000"), &[]).unwrap_err());
        for key in ["kinesis.stream", "kinesis.max_record_size"] {
            assert!(p.iter().any(|p| p.key == key), "{key}: {p:?}");
        }
        let ok = load(
            &k("stream = \"arn:aws:kinesis:eu-west-1:123456789012:stream/orders\""),
            &[],
        )
        .unwrap();
        assert_eq!(ok.destinations.kinesis.region_or_arn(), Some("eu-west-1"));
        assert!(ok.destinations.kinesis.strict_order);
    }
}
