//! What AWS services' refusals mean for the entries they concern (SNS, SQS,
//! EventBridge, Kinesis, S3), by the error's typed parts alone (HTTP status,
//! error code, `SenderFault`), never by its message text: one table
//! ([`classify`]), pinned by a table test. The JSON protocols' codes come
//! without their namespace (`com.amazonaws.sqs#QueueDoesNotExist` is
//! `QueueDoesNotExist`, see [`crate::sink::aws::json`]).
//!
//! | class | when | outcome |
//! |---|---|---|
//! | [`Class::Invalid`] | `InvalidParameter`, `ValidationException` and the other codes of a bad request; an entry failure with `SenderFault=true`; any other 4xx code | rejected: recorded FAILED. A request of several entries refused so is narrowed down (each entry sent alone) |
//! | [`Class::Missing`] | `NotFound`, `QueueDoesNotExist`, `ResourceNotFoundException` | rejected, every entry: the topic, queue, bus or stream does not exist |
//! | [`Class::Access`] | credentials, signatures, permissions, the destination's KMS key | retried forever, logged as an error (an operator fixes it) |
//! | [`Class::Throttled`] | `Throttling`, `ProvisionedThroughputExceededException` and kin, HTTP 429 | retried forever |
//! | [`Class::Unavailable`] | `InternalError`, `InternalFailure` and kin, any 5xx, no connection | retried forever |
//! | [`Class::TimedOut`] | no answer within the attempt or operation timeout | retried forever |
//! | [`Class::Unknown`] | an entry failure of an unknown code that is not the sender's fault; an answer without an error code that is not 5xx; a success that cannot be read | retried for the sink's `retry_unknown_errors_for`, then recorded |
//!
//! Throttling and access codes win over `SenderFault=true` (SNS marks a
//! throttled request as the sender's), and the 4xx rule applies only to codes
//! that are not known: a 4xx answer must be the service's own verdict on the
//! request before it condemns anything, so a 4xx without an AWS error body (a
//! proxy's page) is `Unknown`, not `Invalid`.

use crate::pipeline::sink::Cause;
pub(crate) use crate::sink::unknown::UnknownSince;

/// What an answer means for the entries it concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The entry is wrong; sending it again cannot help.
    Invalid,
    /// The destination (topic, queue, bus, stream) does not exist.
    Missing,
    /// Credentials, permissions or the topic's KMS key: fixed by an operator.
    Access,
    /// SNS asks the relay to slow down.
    Throttled,
    /// SNS, or the way to it, failed.
    Unavailable,
    /// No answer in time.
    TimedOut,
    /// Nothing says whose fault it is.
    Unknown,
}

impl Class {
    /// What a retry for this class says about the destination's load, for
    /// the publisher's concurrency limit: only throttling, timeouts and
    /// SNS's own failures are load; credentials, a wrong entry or an
    /// unknown code are not (sending less would not help them).
    pub fn cause(self) -> Cause {
        match self {
            Self::Throttled => Cause::Throttled,
            Self::TimedOut => Cause::TimedOut,
            Self::Unavailable => Cause::Unavailable,
            Self::Invalid | Self::Missing | Self::Access | Self::Unknown => Cause::Other,
        }
    }

    /// The class of a call that got no answer: credentials and signing are
    /// an operator's to fix, a timeout and a broken connection are outages.
    pub fn of(error: &crate::sink::aws::CallError) -> Self {
        use crate::sink::aws::CallError;
        match error {
            CallError::Timeout { .. } => Self::TimedOut,
            CallError::Credentials(_) | CallError::Signing(_) => Self::Access,
            CallError::Connect { .. } | CallError::Io { .. } => Self::Unavailable,
        }
    }

    /// Whether the entries are recorded as failed at once.
    pub fn rejects(self) -> bool {
        matches!(self, Self::Invalid | Self::Missing)
    }

    /// Whether a request of several entries refused so is sent again entry by
    /// entry, so that one bad entry does not condemn (or hold) the others.
    pub fn narrows(self) -> bool {
        matches!(self, Self::Invalid | Self::Unknown)
    }
}

/// The class of a refusal: `status` is the HTTP status of a refused request
/// (`None` for one entry's failure in a successful `PublishBatch` answer),
/// `code` SNS's error code (`None` when the answer had none), `sender_fault`
/// the entry's `SenderFault` (`None` for a request).
pub fn classify(status: Option<u16>, code: Option<&str>, sender_fault: Option<bool>) -> Class {
    if let Some(code) = code {
        if let Some(class) = known(code) {
            return class;
        }
    }
    match status {
        Some(500..=599) => Class::Unavailable,
        Some(429) => Class::Throttled,
        Some(400..=499) if code.is_some() => Class::Invalid,
        Some(_) => Class::Unknown,
        None if sender_fault == Some(true) => Class::Invalid,
        None => Class::Unknown,
    }
}

/// The class of the codes known to mean one thing whatever the status.
fn known(code: &str) -> Option<Class> {
    Some(match code {
        "InvalidParameter"
        | "InvalidParameterValue"
        | "InvalidParameterException"
        | "ParameterValueInvalid"
        | "MissingParameter"
        | "ValidationError"
        | "ValidationException"
        | "InvalidMessageContents"
        | "BatchRequestTooLong"
        | "InvalidBatchEntryId"
        | "BatchEntryIdsNotDistinct"
        | "EmptyBatchRequest"
        | "TooManyEntriesInBatchRequest"
        | "BatchRequestTooLongException"
        | "InvalidBatchEntryIdException"
        | "BatchEntryIdsNotDistinctException"
        | "EmptyBatchRequestException"
        | "TooManyEntriesInBatchRequestException"
        | "InvalidMessageContentsException"
        | "InvalidArgument"
        | "InvalidArgumentException"
        | "MalformedDetail"
        | "MalformedQueryString"
        | "SerializationException" => Class::Invalid,
        "NotFound"
        | "NotFoundException"
        | "QueueDoesNotExist"
        | "AWS.SimpleQueueService.NonExistentQueue"
        | "InvalidAddress"
        | "ResourceNotFoundException" => Class::Missing,
        "AuthorizationError"
        | "AuthorizationErrorException"
        | "RequestExpired"
        | "RequestTimeTooSkewed"
        | "InvalidSignatureException"
        | "AccessDenied"
        | "AccessDeniedException"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "ExpiredToken"
        | "ExpiredTokenException"
        | "UnrecognizedClientException"
        | "MissingAuthenticationToken"
        | "MissingAuthenticationTokenException"
        | "IncompleteSignature"
        | "IncompleteSignatureException"
        | "InvalidSecurity"
        | "OptInRequired"
        | "KMSAccessDenied"
        | "KMSDisabled"
        | "KMSInvalidState"
        | "KMSNotFound"
        | "KMSOptInRequired"
        | "KmsAccessDenied"
        | "KmsDisabled"
        | "KmsInvalidKeyUsage"
        | "KMSInvalidKeyUsageException"
        | "KmsInvalidState"
        | "KmsNotFound"
        | "KmsOptInRequired"
        | "KMSAccessDeniedException"
        | "KMSDisabledException"
        | "KMSInvalidStateException"
        | "KMSNotFoundException"
        | "KMSOptInRequiredException"
        | "NotAuthorized"
        | "NotAuthorizedForSourceException"
        | "NotAuthorizedForDetailTypeException"
        | "InvalidSecurityException" => Class::Access,
        "Throttling"
        | "ThrottlingException"
        | "ThrottledException"
        | "Throttled"
        | "RequestThrottled"
        | "RequestLimitExceeded"
        | "TooManyRequestsException"
        | "SlowDown"
        | "KMSThrottling"
        | "KmsThrottled"
        | "KMSThrottlingException"
        | "ProvisionedThroughputExceededException"
        | "LimitExceededException" => Class::Throttled,
        "InternalError"
        | "InternalFailure"
        | "InternalErrorException"
        | "ServiceUnavailable"
        | "ServiceUnavailableException"
        | "Unavailable"
        | "InternalServerError"
        | "InternalException" => Class::Unavailable,
        _ => return None,
    })
}

/// Whether SNS's error `code` says the credentials are good but may not do
/// what was asked (rather than being unknown, expired or badly signed).
pub(crate) fn permission_denied(code: &str) -> bool {
    matches!(
        code,
        "AuthorizationError"
            | "AuthorizationErrorException"
            | "AccessDenied"
            | "AccessDeniedException"
    )
}

/// What a refusal (an answer of `status` other than success, from
/// `endpoint`, with `body`, whose error the protocol parsed as `error`)
/// says: its class, the service's error code, and a reason (the code and
/// message, else the status, the endpoint and the start of the body).
pub(crate) fn refusal(
    status: hyper::StatusCode,
    endpoint: &str,
    body: &[u8],
    error: Option<(String, Option<String>)>,
) -> (Class, Option<String>, String) {
    let (code, reason) = match error {
        Some((code, message)) => {
            let reason = format!("{code}: {}", message.as_deref().unwrap_or("no message"));
            (Some(code), reason)
        }
        None => (
            None,
            format!(
                "HTTP {status} from {endpoint}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
            ),
        ),
    };
    let class = classify(Some(status.as_u16()), code.as_deref(), None);
    (class, code, reason)
}

/// Whether SNS's error `code` says the credentials themselves are expired
/// or unknown (so the cached ones are dropped and the chain asked again).
pub(crate) fn stale_credentials(code: &str) -> bool {
    matches!(
        code,
        "ExpiredToken"
            | "ExpiredTokenException"
            | "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "InvalidAccessKeyId"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_refusal_has_its_class() {
        use Class::*;
        let request = |status: u16, code: Option<&str>| classify(Some(status), code, None);
        let entry = |code: &str, sender_fault: bool| classify(None, Some(code), Some(sender_fault));
        let table: &[(&str, Class, Class)] = &[
            // what, as a request refused with it, as an entry failed with it
            (
                "InvalidParameter",
                request(400, Some("InvalidParameter")),
                Invalid,
            ),
            (
                "ValidationException",
                request(400, Some("ValidationException")),
                Invalid,
            ),
            (
                "ValidationError",
                request(400, Some("ValidationError")),
                Invalid,
            ),
            (
                "ParameterValueInvalid",
                request(400, Some("ParameterValueInvalid")),
                Invalid,
            ),
            (
                "BatchRequestTooLong",
                request(400, Some("BatchRequestTooLong")),
                Invalid,
            ),
            (
                "an unknown 4xx code",
                request(400, Some("SomethingNew")),
                Invalid,
            ),
            (
                "an unknown 409 code",
                request(409, Some("ConcurrentAccess")),
                Invalid,
            ),
            ("NotFound", request(404, Some("NotFound")), Missing),
            (
                "AuthorizationError",
                request(403, Some("AuthorizationError")),
                Access,
            ),
            (
                "InvalidClientTokenId",
                request(403, Some("InvalidClientTokenId")),
                Access,
            ),
            ("KMSDisabled", request(400, Some("KMSDisabled")), Access),
            (
                "KmsInvalidKeyUsage (SQS)",
                request(400, Some("KmsInvalidKeyUsage")),
                Access,
            ),
            (
                "IncompleteSignatureException (JSON services)",
                request(400, Some("IncompleteSignatureException")),
                Access,
            ),
            (
                "MissingAuthenticationTokenException (JSON services)",
                request(403, Some("MissingAuthenticationTokenException")),
                Access,
            ),
            ("Throttling", request(400, Some("Throttling")), Throttled),
            (
                "a 429 of any code",
                request(429, Some("SomethingNew")),
                Throttled,
            ),
            ("a 429 without a code", request(429, None), Throttled),
            (
                "InternalError",
                request(500, Some("InternalError")),
                Unavailable,
            ),
            (
                "an unknown 5xx code",
                request(503, Some("SomethingNew")),
                Unavailable,
            ),
            ("a 502 without a code", request(502, None), Unavailable),
            (
                "SQS QueueDoesNotExist",
                request(400, Some("QueueDoesNotExist")),
                Missing,
            ),
            (
                "EventBridge or Kinesis ResourceNotFoundException",
                request(400, Some("ResourceNotFoundException")),
                Missing,
            ),
            (
                "Kinesis record too large",
                request(400, Some("ValidationException")),
                Invalid,
            ),
            (
                "SQS batch too long",
                request(400, Some("BatchRequestTooLong")),
                Invalid,
            ),
            (
                "SQS RequestThrottled",
                request(400, Some("RequestThrottled")),
                Throttled,
            ),
            (
                "Kinesis KMS throttling",
                request(400, Some("KMSThrottlingException")),
                Throttled,
            ),
            ("a 4xx without a code", request(403, None), Unknown),
            ("a 3xx without a code", request(302, None), Unknown),
        ];
        for (what, got, want) in table {
            assert_eq!(got, want, "{what}");
        }
        let entries: &[(&str, bool, Class)] = &[
            ("InvalidParameter", true, Invalid),
            ("InvalidParameter", false, Invalid),
            ("SomethingNew", true, Invalid),
            ("SomethingNew", false, Unknown),
            ("Throttling", true, Throttled),
            ("KMSThrottling", true, Throttled),
            ("KMSAccessDenied", true, Access),
            ("InternalError", false, Unavailable),
            ("InternalError", true, Unavailable),
            ("NotFound", true, Missing),
            ("ProvisionedThroughputExceededException", false, Throttled),
            ("InternalFailure", false, Unavailable),
            ("MalformedDetail", false, Invalid),
            ("InvalidArgument", false, Invalid),
            ("NotAuthorizedForSourceException", false, Access),
        ];
        for (code, sender_fault, want) in entries {
            assert_eq!(
                entry(code, *sender_fault),
                *want,
                "entry {code} sender_fault={sender_fault}"
            );
        }
        for class in [Invalid, Missing] {
            assert!(class.rejects());
        }
        for class in [Access, Throttled, Unavailable, TimedOut, Unknown] {
            assert!(!class.rejects(), "{class:?} is retried");
        }
        assert!(Invalid.narrows() && Unknown.narrows());
        // Of the access errors, only these say the credentials are good.
        assert!(permission_denied("AuthorizationError") && permission_denied("AccessDenied"));
        assert!(
            !permission_denied("SignatureDoesNotMatch")
                && !permission_denied("InvalidClientTokenId")
        );
        assert!(!Missing.narrows() && !Access.narrows() && !Throttled.narrows());
    }
}
