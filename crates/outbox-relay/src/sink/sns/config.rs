//! `[sns]`: the SNS sink's settings, their defaults and their validation.

use std::sync::Arc;

use crate::config::allow;
use crate::config::settings::{check_template, verbatim, Routes, Settings};
use crate::config::value::check_endpoint_url;
use crate::sink::aws::settings::section;

/// Default ceiling of SNS PublishBatch calls in flight: enough for 100k
/// events/s (10 a call) 50 ms away.
pub(crate) const DEFAULT_SNS_IN_FLIGHT_BATCHES: usize = 500;
/// Message attributes always set on SNS messages.
pub(crate) const SNS_FIXED_ATTRIBUTES: [&str; 4] =
    ["event_id", "event_type", "aggregate_type", "aggregate_id"];
/// SNS (and raw SQS delivery) accept at most this many message attributes.
pub(crate) const SNS_MAX_ATTRIBUTES: usize = 10;

section! {
    /// `[sns]`: the SNS sink.
    pub struct SnsConfig in "sns" {
        /// AWS region; empty: from the standard AWS chain (AWS_REGION, profile).
        region, endpoint_url,
        /// The default topic.
        pub topic_arn: String = String::new(),
        /// Topic per event: an ARN template with `{region}`, `{account}`,
        /// `{aggregate_type}`, `{event_type}`; used instead of `topic_arn`.
        pub topic_template: String = String::new(),
        /// Account id for `{account}` and for bare topic names in the topic
        /// column; default: the account of `topic_arn`.
        pub account_id: String = String::new(),
        /// Headers copied into message attributes (besides event_type,
        /// aggregate_type and aggregate_id), for subscription filter policies.
        pub attributes: Vec<String> = vec!["traceparent".to_owned()],
        calls { max_in_flight_batches: DEFAULT_SNS_IN_FLIGHT_BATCHES },
        /// The largest message (body and attributes, in bytes) a topic takes; 0:
        /// each topic's `MaximumMessageSize`, read with `GetTopicAttributes`.
        pub max_message_size: usize = 0,
        /// An S3 bucket for envelopes over their topic's limit (the SNS/SQS
        /// Extended Client Libraries' claim check); empty: such events are
        /// recorded as failed.
        pub large_payload_bucket: String = String::new(),
        /// S3 endpoint override for `large_payload_bucket` (path-style requests).
        pub large_payload_endpoint_url: String = String::new(),
        /// Topics a row's `topic` column or `topic_template` may name besides
        /// those of the configured partition, region and account: ARN patterns,
        /// `*` standing for one name (`arn:aws:sns:*:123456789012:audit-*`).
        pub allowed_destinations: Vec<String> = Vec::new(),
    }
}

impl SnsConfig {
    /// The account of `account_id`, or of `topic_arn`.
    pub fn account(&self) -> Option<&str> {
        if !self.account_id.is_empty() {
            return Some(&self.account_id);
        }
        self.topic_arn.split(':').nth(4).filter(|a| !a.is_empty())
    }

    /// The region of `region`, or of `topic_arn`.
    pub fn region_or_arn(&self) -> Option<&str> {
        if !self.region.is_empty() {
            return Some(&self.region);
        }
        self.topic_arn.split(':').nth(3).filter(|r| !r.is_empty())
    }
}

impl SnsConfig {
    /// The default topic, the template and the destinations they may name.
    fn check_topics(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.topic_arn.is_empty() && self.topic_template.is_empty() {
            bad(
                "sns.topic_arn",
                "missing: set sns.topic_arn (the default topic) or sns.topic_template".into(),
            );
        }
        if !self.topic_arn.is_empty()
            && (!self.topic_arn.starts_with("arn:") || self.topic_arn.split(':').count() != 6)
        {
            bad(
                "sns.topic_arn",
                format!(
                    "{:?} is not a topic ARN like arn:aws:sns:us-east-1:123456789012:orders",
                    self.topic_arn
                ),
            );
        }
        allow::check_patterns("sns.allowed_destinations", &self.allowed_destinations, bad);
        if !self.topic_template.is_empty() && self.routes().allowed.describe().is_empty() {
            bad(
                "sns.topic_template",
                "cannot tell which partition, region and account its topics may be in: \
                 set sns.region and sns.account_id (or sns.topic_arn), or list them in sns.allowed_destinations"
                    .into(),
            );
        }
        if !self.topic_template.is_empty() {
            check_template(
                "sns.topic_template",
                &self.topic_template,
                &["region", "account"],
                bad,
            );
            if self.topic_template.contains("{account}") && self.account().is_none() {
                bad(
                    "sns.account_id",
                    "sns.topic_template uses {account}: set sns.account_id (or sns.topic_arn)"
                        .into(),
                );
            }
            if self.topic_template.contains("{region}") && self.region_or_arn().is_none() {
                bad(
                    "sns.region",
                    "sns.topic_template uses {region}: set sns.region".into(),
                );
            }
        }
    }

    /// The headers copied into message attributes: as many as SNS allows
    /// beside the relay's own (and the claim check's), each a name SNS takes.
    fn check_attributes(&self, bad: &mut dyn FnMut(&str, String)) {
        let attributes = SNS_FIXED_ATTRIBUTES.len() + self.attributes.len();
        if !self.large_payload_bucket.is_empty() && attributes + 1 > SNS_MAX_ATTRIBUTES {
            bad(
                "sns.attributes",
                format!(
                    "with sns.large_payload_bucket a stored payload's message also carries ExtendedPayloadSize: \
                     name at most {} headers",
                    SNS_MAX_ATTRIBUTES - SNS_FIXED_ATTRIBUTES.len() - 1
                ),
            );
        }
        if attributes > SNS_MAX_ATTRIBUTES {
            bad(
                "sns.attributes",
                format!(
                    "{} headers plus event_id, event_type, aggregate_type and aggregate_id make {attributes} \
                     message attributes; SNS and raw SQS delivery allow {SNS_MAX_ATTRIBUTES}: name at most {}",
                    self.attributes.len(),
                    SNS_MAX_ATTRIBUTES - SNS_FIXED_ATTRIBUTES.len()
                ),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for name in &self.attributes {
            if let Err(why) = sns_attribute_name(name) {
                bad(
                    "sns.attributes",
                    format!("{name:?} cannot be a message attribute name: {why}"),
                );
            } else if SNS_FIXED_ATTRIBUTES.contains(&name.as_str()) {
                bad(
                    "sns.attributes",
                    format!("{name:?} is set by the relay itself; leave it out"),
                );
            } else if ["ExtendedPayloadSize", "SQSLargePayloadSize"].contains(&name.as_str()) {
                bad(
                    "sns.attributes",
                    format!(
                        "{name:?} is reserved: the SNS/SQS Extended Client Libraries read it as the mark of a payload stored in S3"
                    ),
                );
            } else if !seen.insert(name.as_str()) {
                bad("sns.attributes", format!("{name:?} is named twice"));
            }
        }
    }

    /// A region set beside `topic_arn` is the topic's: SNS publishes only to
    /// topics of the client's region.
    fn check_region(&self, bad: &mut dyn FnMut(&str, String)) {
        let arn_region = self.topic_arn.split(':').nth(3).filter(|r| !r.is_empty());
        if let (false, Some(arn_region)) = (self.region.is_empty(), arn_region) {
            if arn_region != self.region {
                bad(
                    "sns.region",
                    format!(
                        "{:?} differs from the region of sns.topic_arn ({arn_region:?}); SNS publishes only to topics of the client's region",
                        self.region
                    ),
                );
            }
        }
    }

    /// The largest message and where envelopes over it go.
    fn check_large_payloads(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.max_message_size != 0 && !(1024..=1_048_576).contains(&self.max_message_size) {
            bad(
                "sns.max_message_size",
                "must be 0 (each topic's MaximumMessageSize) or from 1024 to 1048576 bytes, as SNS allows"
                    .into(),
            );
        }
        let bucket = &self.large_payload_bucket;
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
            && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
            && bucket.ends_with(|c: char| c.is_ascii_alphanumeric())
            && !bucket.contains("..");
        if !bucket.is_empty() && !bucket_ok {
            bad(
                "sns.large_payload_bucket",
                format!("{bucket:?} is not an S3 bucket name (3 to 63 lower-case letters, digits, . and -)"),
            );
        }
        if let Err(message) = check_endpoint_url(&self.large_payload_endpoint_url) {
            bad("sns.large_payload_endpoint_url", message);
        }
    }
}

impl Settings for SnsConfig {
    fn allowed_key(&self) -> Option<&'static str> {
        Some("sns.allowed_destinations")
    }

    fn validate(&self, bad: &mut dyn FnMut(&str, String)) {
        self.check_topics(bad);
        self.check_attributes(bad);
        self.check_region(bad);
        self.check_calls(bad);
        self.check_large_payloads(bad);
    }

    fn routes(&self) -> Routes {
        let region = self.region_or_arn().unwrap_or_default().to_owned();
        let account = self.account().unwrap_or_default().to_owned();
        let partition = (self.topic_arn.split(':').nth(1))
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| crate::sink::aws::endpoint::partition(&region))
            .to_owned();
        let own = (!region.is_empty() && !account.is_empty())
            .then(|| format!("arn:{partition}:sns:{region}:{account}:*"));
        // A template whose partition, region and account are written out.
        let templated =
            allow::same_account(&self.topic_template).filter(|rule| !rule.contains('{'));
        let (r, a) = (region.clone(), account.clone());
        Routes {
            default: (!self.topic_arn.is_empty()).then(|| self.topic_arn.clone()),
            template: (!self.topic_template.is_empty()).then(|| self.topic_template.clone()),
            variables: vec![("region", region), ("account", account)],
            expand: Arc::new(move |topic| {
                if topic.starts_with("arn:") {
                    topic.to_owned()
                } else {
                    format!("arn:{partition}:sns:{r}:{a}:{topic}")
                }
            }),
            missing: "no topic: the row names none and sns.topic_arn is not set".into(),
            allowed: allow::aws([own, templated], &self.allowed_destinations),
            escape: verbatim,
        }
    }

    fn dead_letter(&self, name: &str) -> Result<(), String> {
        if name.starts_with("arn:aws") && name.split(':').count() == 6 {
            Ok(())
        } else {
            Err(format!(
                "{name:?} is not a topic ARN like arn:aws:sns:us-east-1:123456789012:dead-letters"
            ))
        }
    }
}

/// Whether SNS (and SQS, which receives the attributes of raw delivery)
/// accepts `name` as a message attribute name ([`crate::sink::aws::message_attribute_name`]).
pub(crate) use crate::sink::aws::message_attribute_name as sns_attribute_name;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{load, problems, MINIMAL};

    #[test]
    fn a_template_without_a_known_account_is_refused_and_a_written_out_one_is_its_own_rule() {
        let sns = |body: &str| format!("{MINIMAL}[sink]\nkind = \"sns\"\n[sns]\n{body}");
        let written = load(
            &sns("topic_template = \"arn:aws:sns:us-east-1:123456789012:{aggregate_type}\""),
            &[],
        )
        .unwrap();
        let allowed = written.destinations.sns.routes().allowed;
        assert!(allowed
            .check("arn:aws:sns:us-east-1:123456789012:orders")
            .is_ok());
        assert!(allowed
            .check("arn:aws:sns:us-east-1:999999999999:orders")
            .is_err());
        let p = problems(load(&sns("topic_template = \"arn:aws:sns:{region}:{account}:{aggregate_type}\"\naccount_id = \"\""), &[]).unwrap_err());
        assert!(
            p.iter()
                .any(|p| p.key == "sns.topic_template" && p.message.contains("account")),
            "{p:?}"
        );
    }

    #[test]
    fn sns_concurrency_is_adaptive_under_its_ceiling_or_a_fixed_number() {
        use crate::pipeline::concurrency::Concurrency;
        let sns = |extra: &str, env: &[(&str, &str)]| {
            load(
                &format!("{MINIMAL}[sink]\nkind = \"sns\"\n[sns]\ntopic_arn = \"arn:aws:sns:eu-west-1:123456789012:t\"\n{extra}"),
                env,
            )
        };
        let c = sns("", &[]).unwrap();
        assert_eq!(
            c.destinations.sns.concurrency(),
            Concurrency::Adaptive {
                ceiling: DEFAULT_SNS_IN_FLIGHT_BATCHES
            }
        );
        let c = sns("concurrency = 16\n", &[]).unwrap();
        assert_eq!(c.destinations.sns.concurrency(), Concurrency::Fixed(16));
        let c = sns("", &[("OUTBOX_RELAY__SNS__CONCURRENCY", "32")]).unwrap();
        assert_eq!(c.destinations.sns.concurrency(), Concurrency::Fixed(32));
        let c = sns("max_in_flight_batches = 64\n", &[]).unwrap();
        assert_eq!(
            c.destinations.sns.concurrency(),
            Concurrency::Adaptive { ceiling: 64 }
        );
        let p = problems(sns("max_in_flight_batches = 4\nconcurrency = 8\n", &[]).unwrap_err());
        assert_eq!(p[0].key, "sns.concurrency");
        assert!(sns("concurrency = \"fast\"\n", &[]).is_err());
    }

    #[test]
    fn the_sns_sink_needs_a_topic_and_at_most_ten_attributes() {
        let text = format!(
            "{MINIMAL}[sink]\nkind = \"sns\"\n[sns]\nattributes = [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"g\", \"h\"]\ntopic_template = \"arn:aws:sns:{{region}}:{{account}}:{{nope}}\"\n"
        );
        let keys: Vec<String> = problems(load(&text, &[]).unwrap_err())
            .into_iter()
            .map(|p| p.key)
            .collect();
        for key in [
            "sns.attributes",
            "sns.topic_template",
            "sns.account_id",
            "sns.region",
        ] {
            assert!(
                keys.contains(&key.to_string()),
                "{key} missing from {keys:?}"
            );
        }
        let ok = format!(
            "{MINIMAL}[sink]\nkind = \"sns\"\n[sns]\ntopic_arn = \"arn:aws:sns:eu-west-1:123456789012:orders.fifo\"\ntopic_template = \"arn:aws:sns:{{region}}:{{account}}:{{aggregate_type}}\"\n"
        );
        let c = load(&ok, &[]).unwrap();
        assert_eq!(c.destinations.sns.account(), Some("123456789012"));
        assert_eq!(c.destinations.sns.region_or_arn(), Some("eu-west-1"));
    }

    #[test]
    fn attribute_names_sns_refuses_are_refused_at_start_up() {
        for good in [
            "traceparent",
            "a.b",
            "x-correlation_id",
            "tenant.v2.id",
            "awsregion",
            "AWS",
            "Amazonian.x",
            &"n".repeat(256),
        ] {
            assert_eq!(sns_attribute_name(good), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            "a..b",
            ".lead",
            "trail.",
            ".",
            "AWS.trace",
            "aws.trace",
            "aWs.x",
            "Amazon.x",
            "AMAZON.x",
            "amazon.",
            "has space",
            "é",
            "a/b",
            "a:b",
            &"n".repeat(257),
        ] {
            assert!(sns_attribute_name(bad).is_err(), "{bad:?} must be refused");
        }
        let text = format!(
            "{MINIMAL}[sink]\nkind = \"sns\"\n[sns]\ntopic_arn = \"arn:aws:sns:us-east-1:123456789012:t\"\n\
             attributes = [\"a..b\", \".lead\", \"trail.\", \"AWS.x\", \"ok\", \"ok\"]\n"
        );
        let mut p = problems(load(&text, &[]).unwrap_err());
        assert_eq!(p.len(), 5, "{p:#?}");
        p.extend(problems(
            load(&text.replace(r#""trail.", "AWS.x""#, r#""event_id""#), &[]).unwrap_err(),
        ));
        assert!(p.iter().all(|p| p.key == "sns.attributes"), "{p:#?}");
        for name in ["a..b", ".lead", "trail.", "AWS.x", "ok", "event_id"] {
            assert!(
                p.iter().any(|p| p.message.contains(&format!("{name:?}"))),
                "{name} is named: {p:#?}"
            );
        }
    }

    #[test]
    fn a_large_payload_bucket_is_checked_and_keeps_room_for_its_attribute() {
        let sns =
            "[sink]\nkind = \"sns\"\n[sns]\ntopic_arn = \"arn:aws:sns:us-east-1:123456789012:t\"\n";
        let ok = load(
            &format!("{MINIMAL}{sns}large_payload_bucket = \"outbox-payloads.v2\"\n"),
            &[],
        )
        .unwrap();
        assert_eq!(
            ok.destinations.sns.large_payload_bucket,
            "outbox-payloads.v2"
        );
        let p = problems(
            load(
                &format!(
                    "{MINIMAL}{sns}large_payload_bucket = \"Bad_Bucket\"\nlarge_payload_endpoint_url = \"localhost:4566\"\n\
                     attributes = [\"a\", \"b\", \"c\", \"d\", \"e\", \"ExtendedPayloadSize\"]\n"
                ),
                &[],
            )
            .unwrap_err(),
        );
        let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "sns.attributes",
                "sns.attributes",
                "sns.large_payload_bucket",
                "sns.large_payload_endpoint_url"
            ],
            "{p:#?}"
        );
        assert!(p[0].message.contains("ExtendedPayloadSize"), "{p:#?}");
        assert!(p[1].message.contains("reserved"), "{p:#?}");
    }
}
