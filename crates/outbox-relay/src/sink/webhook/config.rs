//! `[webhook]`: the webhook sink's settings, their defaults and their
//! validation.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::allow::{self, Allowed};
use crate::config::settings::{check_template, Routes, Settings};
use crate::config::value::{de_duration, Secret};
use crate::pipeline::concurrency::{Concurrency, ConcurrencyMode};

/// Default ceiling of requests in flight: 12,800 events/s one at a time
/// 20 ms away (`batch = true` carries up to 100 events a request).
pub(crate) const DEFAULT_WEBHOOK_IN_FLIGHT: usize = 256;
/// Most events one batched request carries.
pub(crate) const MAX_WEBHOOK_BATCH: usize = 100;

/// `[webhook]`: HTTP POST, signed as the Standard Webhooks specification says.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookConfig {
    /// Where events go: an `http://` or `https://` URL.
    pub url: String,
    /// URL per event, with `{aggregate_type}` and `{event_type}` in its path
    /// (percent-encoded); used instead of `url`. A row's `topic` column, when
    /// set, is the URL itself.
    pub url_template: String,
    /// Origins (`https://host[:port]`) a row's `topic` column or
    /// `url_template` may name besides the origin of `url` (or of
    /// `url_template`); a URL of any other origin is recorded FAILED and
    /// never requested.
    pub allowed_origins: Vec<String>,
    /// The signing secret, `whsec_` and base64 (as Standard Webhooks
    /// libraries generate it); best from `OUTBOX_RELAY__WEBHOOK__SECRET`.
    pub secret: Option<Secret>,
    /// One request per batch (a JSON array of envelopes) instead of one per event.
    pub batch: bool,
    /// Most events in a batched request (1 to 100).
    pub max_batch: usize,
    /// The most requests in flight at once.
    pub max_in_flight: usize,
    /// How many requests are in flight: adaptive (up to `max_in_flight`) or a
    /// fixed number.
    pub concurrency: ConcurrencyMode,
    /// Ceiling of one request, answer included.
    #[serde(deserialize_with = "de_duration")]
    pub timeout: Duration,
    /// How long events answered 404, 409 or 425 (a receiver deploying, a
    /// conflict, too early) are retried before they are recorded as failed.
    #[serde(deserialize_with = "de_duration")]
    pub retry_unknown_errors_for: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            url_template: String::new(),
            allowed_origins: Vec::new(),
            secret: None,
            batch: false,
            max_batch: 10,
            max_in_flight: DEFAULT_WEBHOOK_IN_FLIGHT,
            concurrency: ConcurrencyMode::Adaptive,
            timeout: Duration::from_secs(10),
            retry_unknown_errors_for: Duration::from_secs(600),
        }
    }
}

impl WebhookConfig {
    /// The publisher's concurrency for this sink.
    pub fn concurrency(&self) -> Concurrency {
        self.concurrency.with_ceiling(self.max_in_flight)
    }

    /// The URL whose origin is the configured one: `url`, or the start of
    /// `url_template` before its first placeholder.
    pub fn base(&self) -> &str {
        if self.url.is_empty() {
            self.url_template.split('{').next().unwrap_or_default()
        } else {
            &self.url
        }
    }

    /// The origins data may name: `url`'s and `url_template`'s, then
    /// `allowed_origins`.
    pub fn allowed(&self) -> Result<Allowed, String> {
        let template = self.url_template.split('{').next().unwrap_or_default();
        let configured = [self.url.as_str(), template]
            .into_iter()
            .filter(|u| !u.is_empty());
        Allowed::origins(configured.chain(self.allowed_origins.iter().map(String::as_str)))
    }
}

fn http_url(url: &str) -> Result<(), String> {
    let ok = (url.starts_with("http://") || url.starts_with("https://"))
        && url.parse::<hyper::Uri>().is_ok_and(|u| u.host().is_some());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{url:?} is not an http:// or https:// URL with a host"
        ))
    }
}

impl Settings for WebhookConfig {
    fn allowed_key(&self) -> Option<&'static str> {
        Some("webhook.allowed_origins")
    }

    fn validate(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.url.is_empty() && self.url_template.is_empty() {
            bad(
                "webhook.url",
                "missing: set webhook.url (where events are POSTed) or webhook.url_template".into(),
            );
        }
        if !self.url.is_empty() {
            if let Err(message) =
                http_url(&self.url).and_then(|()| allow::Origin::of(&self.url).map(drop))
            {
                bad("webhook.url", message);
            }
        }
        if !self.url_template.is_empty() {
            check_template("webhook.url_template", &self.url_template, &[], bad);
            if !(self.url_template.starts_with("http://")
                || self.url_template.starts_with("https://"))
            {
                bad(
                    "webhook.url_template",
                    "must start with http:// or https://".into(),
                );
            } else if let Err(message) =
                allow::check_url_template(&self.url_template).and_then(|()| {
                    allow::Origin::of(self.url_template.split('{').next().unwrap_or_default())
                        .map(drop)
                })
            {
                bad("webhook.url_template", message);
            }
        }
        for origin in &self.allowed_origins {
            if let Err(message) = allow::Origin::of(origin) {
                bad("webhook.allowed_origins", message);
            }
        }
        match &self.secret {
            None => bad(
                "webhook.secret",
                "missing: set the signing secret (whsec_ and base64), best with OUTBOX_RELAY__WEBHOOK__SECRET"
                    .into(),
            ),
            Some(secret) => {
                if let Err(message) = super::sign::key(secret.expose()) {
                    bad("webhook.secret", message);
                }
            }
        }
        if !(1..=MAX_WEBHOOK_BATCH).contains(&self.max_batch) {
            bad(
                "webhook.max_batch",
                format!("must be from 1 to {MAX_WEBHOOK_BATCH}"),
            );
        }
        self.concurrency
            .validate("webhook", ("max_in_flight", self.max_in_flight), bad);
        if self.timeout.is_zero() {
            bad("webhook.timeout", "must be greater than zero".into());
        }
    }

    fn routes(&self) -> Routes {
        Routes {
            default: (!self.url.is_empty()).then(|| self.url.clone()),
            template: (!self.url_template.is_empty()).then(|| self.url_template.clone()),
            variables: Vec::new(),
            expand: Arc::new(str::to_owned),
            missing: "no URL: the row names none and webhook.url is not set".into(),
            // Validation has refused what does not parse.
            allowed: self.allowed().unwrap_or_default(),
            escape: allow::encode_path_value,
        }
    }

    fn dead_letter(&self, name: &str) -> Result<(), String> {
        http_url(name)
    }

    fn secrets(&self) -> &'static [&'static str] {
        &["secret"]
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{load, problems, MINIMAL};
    use crate::sink::Settings;

    fn webhook(body: &str) -> String {
        format!("{MINIMAL}[sink]\nkind = \"webhook\"\n[webhook]\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n{body}")
    }

    #[test]
    fn the_url_and_the_template_both_give_their_origin_and_user_information_is_refused() {
        let both = load(
            &webhook(
                "url = \"https://a.test/in\"\nurl_template = \"https://b.test/{aggregate_type}\"",
            ),
            &[],
        )
        .unwrap();
        let allowed = both.destinations.webhook.routes().allowed;
        assert!(
            allowed.check("https://a.test/x").is_ok() && allowed.check("https://b.test/x").is_ok()
        );
        assert!(allowed.check("https://c.test/x").is_err());
        for (body, key) in [
            ("url = \"https://user@a.test/in\"", "webhook.url"),
            (
                "url_template = \"https://{aggregate_type}.a.test/\"",
                "webhook.url_template",
            ),
            (
                "url_template = \"https://a.test/{aggregate_type}?t={event_type}\"",
                "webhook.url_template",
            ),
            (
                "url = \"https://a.test/\"\nallowed_origins = [\"ftp://x\"]",
                "webhook.allowed_origins",
            ),
        ] {
            let p = problems(load(&webhook(body), &[]).unwrap_err());
            assert!(p.iter().any(|p| p.key == key), "{body}: {p:?}");
        }
    }
}
