//! Large payloads in S3, in the format of the AWS SNS/SQS Extended Client
//! Libraries (the claim check), so a consumer using one of them reads the
//! original envelope unchanged.
//!
//! With `sns.large_payload_bucket` set, an envelope that with its attributes
//! is larger than its topic's limit is stored first (`PutObject`, signed for
//! `s3` by the same client as SNS calls), and the message published instead
//! carries:
//!
//! * the body `["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"…","s3Key":"…"}]`
//!   (the libraries' `PayloadS3Pointer`, serialised as Jackson writes it);
//! * the `Number` attribute `ExtendedPayloadSize`: the envelope's size in
//!   bytes, by which the libraries know the body is a pointer;
//! * the other attributes as usual (subscription filter policies still
//!   apply; the libraries allow at most 9 others, checked at start-up).
//!
//! The object key names the event within its source (DESIGN.md invariant
//! 10): `outbox-relay/<system identifier>/<database>/<schema.table>/<event id>`
//! ([`object_key`]; a part that is not URI-safe is replaced by its SHA-256).
//! A retry, a restart and a `replay` of the event store the same object and
//! carry the same pointer; two tables, databases or clusters sharing the bucket
//! with overlapping ids (text or bigint ids, a partitioned table whose key is
//! `(id, created_at)`) never name one object for two events, so a consumer
//! never reads another event's payload. A lifecycle rule on the prefix
//! `outbox-relay/` expires them.
//! The relay never deletes objects: consumers may read a message more than
//! once, and a message may be read long after it was sent; a lifecycle rule
//! on the bucket expires them (docs/operations.md).
//!
//! A failed store is retried as the publish would be: throttling and 5xx as
//! outages; anything else (no bucket, access denied) as an access error, logged,
//! forever, since an operator fixes it and the event is not at fault.
//! Nothing is published before its payload is stored.

use std::borrow::Cow;

use aws_smithy_xml::decode::{try_data, Document};

use std::sync::PoisonError;

use crate::pipeline::sink::Source;
use crate::sink::aws::errors::{self, Class};
use crate::sink::aws::{Client, Request};

/// The pointer's class name, first in the body.
pub(crate) const POINTER_CLASS: &str = "software.amazon.payloadoffloading.PayloadS3Pointer";
/// The attribute that marks a message as a pointer and gives the payload's
/// size in bytes.
pub(crate) const SIZE_ATTRIBUTE: &str = "ExtendedPayloadSize";

/// Where large payloads go.
pub(crate) struct ClaimCheck {
    client: Client,
    bucket: String,
    /// The keys' prefix for the events' source, once told
    /// ([`crate::pipeline::sink::Sink::source`]).
    prefix: std::sync::RwLock<Option<String>>,
}

impl ClaimCheck {
    /// Payloads go to `bucket` through `client` (for S3, at the bucket's endpoint: [`crate::sink::aws::endpoint::s3_bucket`]).
    pub(crate) fn new(client: Client, bucket: String) -> Self {
        Self {
            client,
            bucket,
            prefix: std::sync::RwLock::new(None),
        }
    }

    /// The events come from `source`.
    pub(crate) fn source(&self, source: &Source) {
        let prefix = prefix(source);
        let mut known = self.prefix.write().unwrap_or_else(PoisonError::into_inner);
        if known.as_ref().is_some_and(|k| *k != prefix) {
            tracing::warn!(prefix = %prefix, "the events' source changed; large payloads are stored under a new prefix");
        }
        *known = Some(prefix);
    }

    /// Store `payload` for the event `event_id`; the body of the message
    /// that points at it.
    pub(crate) async fn store(
        &self,
        event_id: &str,
        payload: &[u8],
    ) -> Result<String, (Class, String)> {
        let prefix = self
            .prefix
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                (
                    Class::Unknown,
                    "the events' source is not known yet (it names the payload's object)"
                        .to_owned(),
                )
            })?;
        let key = object_key(&prefix, event_id);
        let identity = self
            .client
            .identity()
            .await
            .map_err(|error| (Class::Access, error.to_string()))?;
        let stored = self
            .client
            .send(
                &identity,
                Request::put(&key, "application/json", payload.to_vec()),
            )
            .await;
        let where_ = || format!("s3://{}/{key}", self.bucket);
        let (status, body) = stored.map_err(|error| {
            (
                Class::of(&error),
                format!("storing the payload at {}: {error}", where_()),
            )
        })?;
        if status.is_success() {
            return Ok(pointer(&self.bucket, &key));
        }
        let code = s3_error_code(&body);
        let reason = format!(
            "storing the payload at {}: HTTP {status}{}",
            where_(),
            code.as_deref().map(|c| format!(" {c}")).unwrap_or_default()
        );
        let class = match errors::classify(Some(status.as_u16()), code.as_deref(), None) {
            class @ (Class::Throttled | Class::Unavailable | Class::TimedOut) => class,
            _ => Class::Access,
        };
        if class == Class::Access {
            tracing::error!(bucket = %self.bucket, error = %reason, "cannot store a large payload in S3; retrying");
        }
        Err((class, reason))
    }
}

/// The keys' prefix for events of `source`:
/// `outbox-relay/<system identifier>/<database>/<schema.table>/`.
pub(crate) fn prefix(source: &Source) -> String {
    format!(
        "outbox-relay/{}/{}/{}/",
        part(&source.system),
        part(&source.database),
        part(&source.table)
    )
}

/// The object key of the event `event_id` under `prefix`.
pub(crate) fn object_key(prefix: &str, event_id: &str) -> String {
    format!("{prefix}{}", part(event_id))
}

/// A part of a key: itself when it is of URI-safe characters and not too
/// long, else its hex SHA-256.
fn part(value: &str) -> Cow<'_, str> {
    use sha2::Digest as _;
    let safe = !value.is_empty()
        && value.len() <= 200
        && !value.starts_with('.')
        && !crate::sink::aws::batch::looks_hashed(value)
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if safe {
        return Cow::Borrowed(value);
    }
    let digest = sha2::Sha256::digest(value.as_bytes());
    Cow::Owned(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// The pointer body for `key` in `bucket`.
pub(crate) fn pointer(bucket: &str, key: &str) -> String {
    serde_json::json!([POINTER_CLASS, {"s3BucketName": bucket, "s3Key": key}]).to_string()
}

/// The `Code` of an S3 error answer (`<Error><Code>…`).
fn s3_error_code(xml: &[u8]) -> Option<String> {
    let mut doc = Document::try_from(xml).ok()?;
    let mut root = doc.root_element().ok()?;
    if !root.start_el().matches("Error") {
        return None;
    }
    while let Some(mut field) = root.next_tag() {
        if field.start_el().matches("Code") {
            return try_data(&mut field).ok().map(Cow::into_owned);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pointer_is_the_extended_client_libraries_own() {
        // As the Java libraries' Jackson writes a PayloadS3Pointer.
        assert_eq!(
            pointer("my-bucket", "0b6f…"),
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"my-bucket","s3Key":"0b6f…"}]"#
        );
        let uuid = "5f0c2b5e-8d4e-4c39-9c1f-3a0d5d1c9b7a";
        let source = |table: &str| Source {
            system: "7713132220160448154".into(),
            database: "app".into(),
            table: table.into(),
        };
        let orders = prefix(&source("public.outbox"));
        assert_eq!(
            orders,
            "outbox-relay/7713132220160448154/app/public.outbox/"
        );
        assert_eq!(object_key(&orders, uuid), format!("{orders}{uuid}"));
        let odd = object_key(&orders, "order 42/é");
        assert_eq!(odd.len(), orders.len() + 64);
        assert_eq!(odd, object_key(&orders, "order 42/é"), "stable");
        // Another table with the same id names another object.
        let audit = prefix(&source("audit.outbox"));
        assert_ne!(object_key(&audit, "42"), object_key(&orders, "42"));
        // A value that looks like a hash is hashed too: no id names the
        // object another id's hash names.
        let hashed = object_key(&orders, "order 42/é");
        let lookalike = &hashed[orders.len()..];
        assert_ne!(object_key(&orders, lookalike), hashed);
        let odd_table = prefix(&source("public.\"Outbox Table\""));
        assert!(
            odd_table.ends_with('/')
                && odd_table.len() == "outbox-relay/7713132220160448154/app/".len() + 65
        );
        assert_eq!(part("..").len(), 64);
        assert_eq!(
            s3_error_code(b"<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>m</Message></Error>"),
            Some("NoSuchBucket".into())
        );
        assert_eq!(s3_error_code(b"<html/>"), None);
    }
}
