//! `[eventbridge]`: the EventBridge sink's settings, their defaults and
//! their validation.

use crate::config::allow;
use crate::config::settings::{check_template, Routes, Settings};
use crate::sink::aws::settings::{named_routes, section};

/// Default ceiling of `PutEvents` calls in flight.
pub(crate) const DEFAULT_EVENTBRIDGE_IN_FLIGHT_BATCHES: usize = 500;

section! {
    /// `[eventbridge]`: the EventBridge sink.
    pub struct EventBridgeConfig in "eventbridge" {
        /// AWS region; empty: the bus ARN's, else the standard AWS chain.
        region, endpoint_url,
        /// The default event bus: a name (`default`, `orders`) or an ARN.
        pub bus: String = String::new(),
        /// Each event's `Source`, with `{aggregate_type}` and `{event_type}`.
        pub source: String = "outbox-relay".into(),
        /// Each event's `DetailType`, with `{aggregate_type}` and `{event_type}`.
        pub detail_type: String = "{event_type}".into(),
        calls { max_in_flight_batches: DEFAULT_EVENTBRIDGE_IN_FLIGHT_BATCHES },
        /// Send only to buses `DescribeEventBus` says exist (PutEvents takes
        /// events for a bus that does not exist and drops them): an unanswered
        /// check is retried, a role that may not ask stops the relay at start-up.
        /// `false` sends to a bus that cannot be verified.
        pub verify_bus: bool = true,
        /// Buses a row's `topic` column may name besides bare names
        /// (the relay's own account and region) and ARNs of the configured
        /// bus's partition, region and account: ARN patterns, `*` standing for one name.
        pub allowed_destinations: Vec<String> = Vec::new(),
    }
}

impl EventBridgeConfig {
    /// The region of `region`, or of the bus ARN.
    pub fn region_or_arn(&self) -> Option<&str> {
        if !self.region.is_empty() {
            return Some(&self.region);
        }
        crate::sink::aws::arn_region(&self.bus)
    }
}

/// Whether `name` can name an event bus: a name of letters, digits and
/// `.-_/`, or an event bus ARN.
pub(crate) fn bus_name(name: &str) -> Result<(), String> {
    let arn = name.starts_with("arn:") && name.contains(":event-bus/") && name.len() <= 1600;
    let plain = (1..=256).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'/'));
    if arn || plain {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not an event bus name (letters, digits, . - _ /) or ARN (arn:aws:events:<region>:<account>:event-bus/<name>)"
        ))
    }
}

impl Settings for EventBridgeConfig {
    fn allowed_key(&self) -> Option<&'static str> {
        Some("eventbridge.allowed_destinations")
    }

    fn validate(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.bus.is_empty() {
            bad(
                "eventbridge.bus",
                "missing: set eventbridge.bus, the event bus name (e.g. default) or ARN".into(),
            );
        } else if let Err(message) = bus_name(&self.bus) {
            bad("eventbridge.bus", message);
        }
        for (key, value) in [
            ("eventbridge.source", &self.source),
            ("eventbridge.detail_type", &self.detail_type),
        ] {
            if value.trim().is_empty() {
                bad(key, "must not be empty".into());
            }
            check_template(key, value, &[], bad);
        }
        if self.source.starts_with("aws.") {
            bad(
                "eventbridge.source",
                "sources starting with aws. are reserved for AWS services".into(),
            );
        }
        allow::check_patterns(
            "eventbridge.allowed_destinations",
            &self.allowed_destinations,
            bad,
        );
        self.check_calls(bad);
    }

    fn routes(&self) -> Routes {
        named_routes(
            &self.bus,
            &self.allowed_destinations,
            "no event bus: the row names none and eventbridge.bus is not set",
        )
    }

    fn dead_letter(&self, name: &str) -> Result<(), String> {
        bus_name(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{load, problems, MINIMAL};

    #[test]
    fn the_eventbridge_sink_needs_a_bus_and_names_each_bad_key() {
        let eb = |extra: &str| {
            format!("{MINIMAL}\n[sink]\nkind = \"eventbridge\"\n[eventbridge]\n{extra}")
        };
        let p = problems(load(&eb(""), &[]).unwrap_err());
        assert!(p.iter().any(|p| p.key == "eventbridge.bus"), "{p:?}");
        let p = problems(
            load(
                &eb("bus = \"my bus\"\nsource = \"aws.orders\"\ndetail_type = \"{nope}\""),
                &[],
            )
            .unwrap_err(),
        );
        for key in [
            "eventbridge.bus",
            "eventbridge.source",
            "eventbridge.detail_type",
        ] {
            assert!(p.iter().any(|p| p.key == key), "{key}: {p:?}");
        }
        let ok = load(
            &eb("bus = \"arn:aws:events:eu-west-1:123456789012:event-bus/orders\""),
            &[],
        )
        .unwrap();
        assert_eq!(
            ok.destinations.eventbridge.region_or_arn(),
            Some("eu-west-1")
        );
    }
}
