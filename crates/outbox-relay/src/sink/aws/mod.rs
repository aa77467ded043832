//! The AWS layer every AWS destination shares: settings, endpoints,
//! credentials, signing and connections, for any service named by a
//! [`Service`].
//!
//! * [`settings`]: the call settings every destination's section declares
//!   (region, endpoint, calls in flight, timeouts), once.
//! * [`load`]: region, credentials chain and endpoint settings from
//!   `aws-config`'s standard chain (environment, profiles, web identity,
//!   container and instance roles), with the sink's timeouts for the
//!   providers that call out.
//! * [`endpoint`]: where a service's requests go, by the AWS SDK's own order
//!   of settings (the relay's key, `AWS_ENDPOINT_URL_<SERVICE>`,
//!   `AWS_ENDPOINT_URL`, profiles), else the service's rules for the region.
//! * [`Client`]: signed requests (`aws-sigv4`) on hyper-util's pooled
//!   HTTP/1.1 client, with cached credentials, the endpoint's clock when this
//!   host's is off, and a bound on every call.
//! * [`connect`]: the relay's plain-HTTP egress ([`crate::sink::http`]: TCP,
//!   proxies, TLS, pooling) set up for one service's endpoint.
//!
//! What a destination adds in its own folder: its wire protocol (request
//! bodies, answers), its error classes and its limits. The concurrency
//! control all destinations share is [`crate::pipeline::concurrency`].

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};

pub(crate) mod batch;
mod client;
pub(crate) mod connect;
pub(crate) mod endpoint;
pub(crate) mod errors;
pub(crate) mod json;
pub(crate) mod known;
#[cfg(test)]
pub(crate) mod local;
pub(crate) mod query;
pub(crate) mod settings;

pub(crate) use crate::config::settings::SetupError;
pub(crate) use client::{CallError, Client, Request};

/// An AWS service as the layer needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// The SigV4 signing name (`sns`, `s3`, `sqs`, `events`, `kinesis`).
    pub signing_name: &'static str,
    /// The SDK's service id, which names its endpoint settings
    /// (`AWS_ENDPOINT_URL_<ID>`, a profile's `services` section).
    pub service_id: &'static str,
    /// The environment variable of its endpoint, for messages.
    pub endpoint_variable: &'static str,
}

/// Amazon SNS.
pub(crate) const SNS: Service = Service {
    signing_name: "sns",
    service_id: "SNS",
    endpoint_variable: "AWS_ENDPOINT_URL_SNS",
};

/// Amazon S3.
pub(crate) const S3: Service = Service {
    signing_name: "s3",
    service_id: "S3",
    endpoint_variable: "AWS_ENDPOINT_URL_S3",
};

/// Amazon SQS.
pub(crate) const SQS: Service = Service {
    signing_name: "sqs",
    service_id: "SQS",
    endpoint_variable: "AWS_ENDPOINT_URL_SQS",
};

/// Amazon EventBridge.
pub(crate) const EVENTBRIDGE: Service = Service {
    signing_name: "events",
    service_id: "EventBridge",
    endpoint_variable: "AWS_ENDPOINT_URL_EVENTBRIDGE",
};

/// Amazon Kinesis Data Streams.
pub(crate) const KINESIS: Service = Service {
    signing_name: "kinesis",
    service_id: "Kinesis",
    endpoint_variable: "AWS_ENDPOINT_URL_KINESIS",
};

/// The headers named in `names`, from the row's headers (a JSON object), as
/// message attribute values: a string as it is, a number, boolean, array or
/// object as its JSON text. Absent, `null` and empty ones are left out (the
/// services refuse empty attribute values), and so is every header of a row
/// whose headers are not a JSON object.
pub(crate) fn header_values<'a>(
    headers: Option<&str>,
    names: &'a [String],
) -> Vec<(&'a str, String)> {
    let Some(headers) = headers.filter(|_| !names.is_empty()) else {
        return Vec::new();
    };
    let Ok(mut map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(headers)
    else {
        return Vec::new();
    };
    names
        .iter()
        .filter_map(|name| {
            let value = match map.remove(name)? {
                serde_json::Value::Null => return None,
                serde_json::Value::String(text) => text,
                other => other.to_string(),
            };
            (!value.is_empty()).then_some((name.as_str(), value))
        })
        .collect()
}

/// Whether SNS and SQS accept `name` as a message attribute name: 1 to 256
/// characters of ASCII letters, digits, `_`, `-` and `.`; no `.` first, last
/// or twice in a row; no `AWS.` or `Amazon.` prefix in any casing (reserved
/// for AWS). The service refuses a message whose attribute breaks one of
/// these, so every event carrying such a header would end FAILED: refused at
/// start-up instead.
pub(crate) fn message_attribute_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > 256 {
        return Err("it is longer than 256 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err("only ASCII letters, digits, _, - and . are allowed");
    }
    if name.starts_with('.') || name.ends_with('.') {
        return Err("it must not start or end with a period");
    }
    if name.contains("..") {
        return Err("it must not have two periods in a row");
    }
    let reserved = |prefix: &str| {
        name.get(..prefix.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
    };
    if reserved("aws.") || reserved("amazon.") {
        return Err("the prefixes AWS. and Amazon. (in any casing) are reserved for AWS");
    }
    Ok(())
}

/// The region of an ARN (`arn:aws:kinesis:eu-west-1:…` is `eu-west-1`), if
/// `name` is one.
pub(crate) fn arn_region(name: &str) -> Option<&str> {
    name.strip_prefix("arn:")
        .and_then(|arn| arn.split(':').nth(2))
        .filter(|r| !r.is_empty())
}

/// What an AWS destination's section says about its calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Calls<'a> {
    /// The region set for the sink (or read from its destination), if any.
    pub region: Option<&'a str>,
    /// Its key (`sqs.region`).
    pub region_key: &'static str,
    /// The endpoint set for the sink, empty when unset.
    pub endpoint_url: &'a str,
    /// Its key (`sqs.endpoint_url`).
    pub endpoint_key: &'static str,
    /// Calls in flight at most (idle connections kept).
    pub max_in_flight: usize,
    /// Ceiling of one call.
    pub operation_timeout: Duration,
    /// Ceiling of one attempt.
    pub attempt_timeout: Duration,
}

/// A client for `service` as `calls` says: the standard settings
/// ([`load`]), the endpoint by the SDK's order ([`endpoint::for_service`],
/// `prefix` naming the service's regional host).
pub(crate) async fn client(
    service: Service,
    prefix: &str,
    calls: Calls<'_>,
) -> Result<Client, SetupError> {
    let (sdk, region) = load(
        calls.region,
        calls.region_key,
        calls.operation_timeout,
        calls.attempt_timeout,
    )
    .await?;
    let (key, url) = endpoint::for_service(
        &sdk,
        &service,
        (calls.endpoint_key, calls.endpoint_url),
        prefix,
        &region,
        calls.region_key,
    );
    let client = Client::new(
        &sdk,
        service,
        &region,
        (key, &url),
        calls.max_in_flight,
        calls.attempt_timeout,
    )?;
    tracing::debug!(endpoint = client.endpoint(), region = %region, service = service.signing_name, "AWS client ready");
    Ok(client)
}

/// The AWS settings for a destination: the standard chain, `region` (a
/// relay setting) over `AWS_REGION` and profiles, and the timeouts of the
/// credential providers that call out (instance metadata, STS, SSO). Fails,
/// naming `region_key`, when no region is set anywhere.
pub(crate) async fn load(
    region: Option<&str>,
    region_key: &'static str,
    operation_timeout: Duration,
    attempt_timeout: Duration,
) -> Result<(SdkConfig, String), SetupError> {
    let timeouts = TimeoutConfig::builder()
        .operation_timeout(operation_timeout)
        .operation_attempt_timeout(attempt_timeout)
        .connect_timeout(attempt_timeout.min(Duration::from_secs(3)))
        .build();
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .timeout_config(timeouts)
        .retry_config(RetryConfig::standard());
    if let Some(region) = region {
        loader = loader.region(Region::new(region.to_owned()));
    }
    let sdk = loader.load().await;
    let Some(region) = sdk.region().map(ToString::to_string) else {
        return Err(SetupError {
            key: region_key,
            message: format!("no AWS region: set {region_key}, or AWS_REGION"),
        });
    };
    Ok((sdk, region))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_are_text_and_empty_ones_are_left_out() {
        let names: Vec<String> = [
            "traceparent",
            "tenant",
            "retry",
            "tags",
            "none",
            "empty",
            "absent",
        ]
        .map(String::from)
        .into();
        let headers = r#"{"traceparent":"00-ab-cd-01","tenant":42,"retry":true,"tags":["a"],"none":null,"empty":"","other":"x"}"#;
        assert_eq!(
            header_values(Some(headers), &names),
            [
                ("traceparent", "00-ab-cd-01".to_owned()),
                ("tenant", "42".to_owned()),
                ("retry", "true".to_owned()),
                ("tags", r#"["a"]"#.to_owned()),
            ]
        );
        assert!(
            header_values(Some("[1]"), &names).is_empty(),
            "not an object"
        );
        assert!(header_values(None, &names).is_empty());
        assert!(header_values(Some(headers), &[]).is_empty());
    }
}
