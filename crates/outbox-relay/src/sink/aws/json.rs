//! The AWS JSON protocols (1.0 for SQS, 1.1 for EventBridge and Kinesis):
//! a `POST` of a JSON body to the endpoint's root, the operation named by
//! `X-Amz-Target`, errors answered as `{"__type": …, "message": …}`.

use hyper::header::{HeaderName, HeaderValue};
use hyper::Method;

use super::Request;

/// `Content-Type` of AWS JSON 1.0 (SQS).
pub(crate) const JSON_10: &str = "application/x-amz-json-1.0";
/// `Content-Type` of AWS JSON 1.1 (EventBridge, Kinesis).
pub(crate) const JSON_11: &str = "application/x-amz-json-1.1";

/// The header naming the operation.
pub(crate) fn target(operation: &'static str) -> [(HeaderName, HeaderValue); 1] {
    [(
        HeaderName::from_static("x-amz-target"),
        HeaderValue::from_static(operation),
    )]
}

/// A call of the operation `target` names ([`target`]) with `body`.
pub(crate) fn request<'a>(
    content_type: &'static str,
    target: &'a [(HeaderName, HeaderValue)],
    body: Vec<u8>,
) -> Request<'a> {
    Request {
        method: Method::POST,
        key: "",
        content_type,
        headers: target,
        body,
    }
}

/// The error code and message of a refused call's answer: `__type` without
/// its namespace (`com.amazonaws.sqs#QueueDoesNotExist`) or the legacy
/// suffix (`…:http://internal.amazon.com/…`), and `message` (or `Message`).
/// `None` when the body is not an AWS JSON error (a proxy's page).
pub fn parse_error(body: &[u8]) -> Option<(String, Option<String>)> {
    // A map, not a struct: SQS's answers carry `message` and `Message` both.
    let error: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body).ok()?;
    let text = |key: &str| error.get(key).and_then(serde_json::Value::as_str);
    let kind = text("__type").or_else(|| text("code"))?;
    let code = kind.rsplit('#').next().unwrap_or(kind);
    let code = code.split(':').next().unwrap_or(code).trim();
    if code.is_empty() {
        return None;
    }
    let message = text("message")
        .or_else(|| text("Message"))
        .map(str::to_owned);
    Some((code.to_owned(), message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_lose_their_namespace() {
        assert_eq!(
            parse_error(br#"{"__type":"com.amazonaws.sqs#QueueDoesNotExist","message":"gone"}"#),
            Some(("QueueDoesNotExist".into(), Some("gone".into())))
        );
        assert_eq!(
            parse_error(br#"{"__type":"ResourceNotFoundException","Message":"no bus"}"#),
            Some(("ResourceNotFoundException".into(), Some("no bus".into())))
        );
        assert_eq!(
            parse_error(
                br#"{"__type":"SerializationException:http://internal.amazon.com/coral/com.amazon.coral.service/"}"#
            ),
            Some(("SerializationException".into(), None))
        );
        // SQS's own answer: both spellings of the message.
        assert_eq!(
            parse_error(
                br#"{"__type": "com.amazonaws.sqs#QueueDoesNotExist", "message": "The specified queue does not exist.", "Message": "The specified queue does not exist."}"#
            ),
            Some((
                "QueueDoesNotExist".into(),
                Some("The specified queue does not exist.".into())
            ))
        );
        assert_eq!(parse_error(b"<html>Bad Gateway</html>"), None);
        assert_eq!(parse_error(br#"{"__type":""}"#), None);
    }
}
