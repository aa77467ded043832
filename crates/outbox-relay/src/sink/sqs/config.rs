//! `[sqs]`: the SQS sink's settings, their defaults and their validation.

use std::sync::Arc;

use crate::config::allow;
use crate::config::settings::{check_template, verbatim, Routes, Settings};
use crate::sink::aws::settings::section;

/// Default ceiling of `SendMessageBatch` calls in flight.
pub(crate) const DEFAULT_SQS_IN_FLIGHT_BATCHES: usize = 500;
/// Message attributes always set.
pub(crate) const SQS_FIXED_ATTRIBUTES: [&str; 4] =
    ["event_id", "event_type", "aggregate_type", "aggregate_id"];
/// SQS accepts at most this many message attributes.
pub(crate) const SQS_MAX_ATTRIBUTES: usize = 10;
/// The most `MaximumMessageSize` can be (and its default since 2025).
pub(crate) const SQS_MAX_MESSAGE_SIZE: usize = 1_048_576;

section! {
    /// `[sqs]`: the SQS sink.
    pub struct SqsConfig in "sqs" {
        /// AWS region; empty: the queue URL's, else the standard AWS chain.
        region, endpoint_url,
        /// The default queue's URL (`https://sqs.<region>.amazonaws.com/<account>/<name>`).
        pub queue_url: String = String::new(),
        /// Queue URL per event, with `{aggregate_type}` and `{event_type}`; used
        /// instead of `queue_url`.
        pub queue_template: String = String::new(),
        /// Headers copied into message attributes (besides event_id,
        /// event_type, aggregate_type and aggregate_id).
        pub attributes: Vec<String> = vec!["traceparent".to_owned()],
        calls { max_in_flight_batches: DEFAULT_SQS_IN_FLIGHT_BATCHES },
        /// The largest message (body and attributes, in bytes) a queue takes; 0:
        /// each queue's `MaximumMessageSize`, read with `GetQueueAttributes`.
        pub max_message_size: usize = 0,
        /// Queues a row's `topic` column or `queue_template` may name besides
        /// those beside the configured queue (same host and account): queue URL
        /// patterns, `*` standing for one name
        /// (`https://sqs.eu-west-1.amazonaws.com/123456789012/audit-*`).
        pub allowed_destinations: Vec<String> = Vec::new(),
    }
}

impl SqsConfig {
    /// The region of `region`, or of the queue URL's host
    /// (`sqs.<region>.amazonaws.com`, or the legacy `<region>.queue.amazonaws.com`).
    pub fn region_or_url(&self) -> Option<&str> {
        if !self.region.is_empty() {
            return Some(&self.region);
        }
        let url = if self.queue_url.is_empty() {
            &self.queue_template
        } else {
            &self.queue_url
        };
        let host = url.split("://").nth(1)?.split('/').next()?;
        let mut labels = host.split('.');
        match (labels.next()?, labels.next()?) {
            ("sqs", region) if host.contains(".amazonaws.") => Some(region),
            (region, "queue") if host.contains(".amazonaws.") => Some(region),
            _ => None,
        }
    }

    /// The URL a bare queue name is appended to: `queue_url` (or the
    /// template) up to its last `/`.
    fn base(&self) -> String {
        let url = if self.queue_url.is_empty() {
            &self.queue_template
        } else {
            &self.queue_url
        };
        base_of(url)
    }
}

/// A queue URL up to and with its last `/` (host and account).
fn base_of(url: &str) -> String {
    url.rfind('/')
        .map_or_else(String::new, |i| url[..=i].to_owned())
}

/// Whether `url` looks like a queue URL: http(s), a host, and a path of
/// account and name.
fn queue_url(url: &str) -> Result<(), String> {
    let ok = (url.starts_with("https://") || url.starts_with("http://"))
        && url.parse::<hyper::Uri>().is_ok_and(|u| {
            u.host().is_some() && u.path().trim_matches('/').split('/').count() == 2
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{url:?} is not a queue URL like https://sqs.us-east-1.amazonaws.com/123456789012/orders"
        ))
    }
}

impl Settings for SqsConfig {
    fn allowed_key(&self) -> Option<&'static str> {
        Some("sqs.allowed_destinations")
    }

    fn validate(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.queue_url.is_empty() && self.queue_template.is_empty() {
            bad(
                "sqs.queue_url",
                "missing: set sqs.queue_url (the default queue) or sqs.queue_template".into(),
            );
        }
        if !self.queue_url.is_empty() {
            if let Err(message) = queue_url(&self.queue_url) {
                bad("sqs.queue_url", message);
            }
        }
        if !self.queue_template.is_empty() {
            check_template("sqs.queue_template", &self.queue_template, &[], bad);
            if let Err(message) = queue_url(&self.queue_template.replace(['{', '}'], "")) {
                bad("sqs.queue_template", message);
            } else if base_of(&self.queue_template).contains('{') {
                bad(
                    "sqs.queue_template",
                    "placeholders may stand only in the queue's name (after the account's /), so a row's values cannot choose the host or account".into(),
                );
            }
        }
        allow::check_patterns("sqs.allowed_destinations", &self.allowed_destinations, bad);
        let attributes = SQS_FIXED_ATTRIBUTES.len() + self.attributes.len();
        if attributes > SQS_MAX_ATTRIBUTES {
            bad(
                "sqs.attributes",
                format!(
                    "{} headers plus event_id, event_type, aggregate_type and aggregate_id make {attributes} \
                     message attributes; SQS allows {SQS_MAX_ATTRIBUTES}: name at most {}",
                    self.attributes.len(),
                    SQS_MAX_ATTRIBUTES - SQS_FIXED_ATTRIBUTES.len()
                ),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for name in &self.attributes {
            if let Err(why) = crate::sink::aws::message_attribute_name(name) {
                bad(
                    "sqs.attributes",
                    format!("{name:?} cannot be a message attribute name: {why}"),
                );
            } else if SQS_FIXED_ATTRIBUTES.contains(&name.as_str()) {
                bad(
                    "sqs.attributes",
                    format!("{name:?} is set by the relay itself; leave it out"),
                );
            } else if !seen.insert(name.as_str()) {
                bad("sqs.attributes", format!("{name:?} is named twice"));
            }
        }
        if self.max_message_size != 0
            && !(1024..=SQS_MAX_MESSAGE_SIZE).contains(&self.max_message_size)
        {
            bad(
                "sqs.max_message_size",
                format!(
                    "must be 0 (each queue's MaximumMessageSize) or from 1024 to {SQS_MAX_MESSAGE_SIZE} bytes, as SQS allows"
                ),
            );
        }
        self.check_calls(bad);
    }

    fn routes(&self) -> Routes {
        let base = self.base();
        let own = base.clone();
        Routes {
            default: (!self.queue_url.is_empty()).then(|| self.queue_url.clone()),
            template: (!self.queue_template.is_empty()).then(|| self.queue_template.clone()),
            variables: Vec::new(),
            expand: Arc::new(move |queue| {
                if queue.starts_with("https://") || queue.starts_with("http://") {
                    queue.to_owned()
                } else {
                    format!("{own}{queue}")
                }
            }),
            missing: "no queue: the row names none and sqs.queue_url is not set".into(),
            allowed: allow::aws(
                [&self.queue_url, &self.queue_template].map(|url| {
                    let base = base_of(url);
                    (!base.is_empty() && !base.contains('{')).then(|| format!("{base}*"))
                }),
                &self.allowed_destinations,
            ),
            escape: verbatim,
        }
    }

    fn dead_letter(&self, name: &str) -> Result<(), String> {
        queue_url(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{load, problems, MINIMAL};

    #[test]
    fn the_sqs_sink_needs_a_queue_url_and_names_each_bad_key() {
        let sqs = |extra: &str| format!("{MINIMAL}\n[sink]\nkind = \"sqs\"\n[sqs]\n{extra}");
        let p = problems(load(&sqs(""), &[]).unwrap_err());
        assert!(p.iter().any(|p| p.key == "sqs.queue_url"), "{p:?}");
        let p = problems(load(&sqs("queue_url = \"orders\""), &[]).unwrap_err());
        assert!(
            p.iter()
                .any(|p| p.key == "sqs.queue_url" && p.message.contains("not a queue URL")),
            "{p:?}"
        );
        let p = problems(load(&sqs(
            "queue_url = \"https://sqs.eu-west-1.amazonaws.com/123456789012/orders\"\nattributes = [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"g\"]\nmax_message_size = 10\nattempt_timeout = \"20s\"",
        ), &[]).unwrap_err());
        for key in [
            "sqs.attributes",
            "sqs.max_message_size",
            "sqs.attempt_timeout",
        ] {
            assert!(p.iter().any(|p| p.key == key), "{key}: {p:?}");
        }
        let ok = load(
            &sqs("queue_url = \"https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo\""),
            &[],
        )
        .unwrap();
        let s = &ok.destinations.sqs;
        assert_eq!(s.region_or_url(), Some("eu-west-1"));
        let routes = crate::sink::Settings::routes(s);
        assert_eq!(
            (routes.expand)("payments"),
            "https://sqs.eu-west-1.amazonaws.com/123456789012/payments"
        );
        assert_eq!((routes.expand)("http://x/1/q"), "http://x/1/q");
    }
}
