//! Standard Webhooks signatures: `webhook-signature: v1,<base64 of
//! HMAC-SHA256(key, "<webhook-id>.<webhook-timestamp>.<body>")>`, the key
//! being the secret's base64 after its `whsec_` prefix.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// The signing key of `secret` (`whsec_<base64>`, or the base64 alone), or
/// what is wrong with it (never echoing it).
pub(super) fn key(secret: &str) -> Result<ring::hmac::Key, String> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    let bytes = STANDARD.decode(encoded).map_err(|_| {
        "is not whsec_ followed by base64 (the form Standard Webhooks libraries generate)"
            .to_owned()
    })?;
    if bytes.len() < 24 {
        return Err(format!(
            "holds {} bytes: use at least 24 random bytes (Standard Webhooks recommends 24 to 64)",
            bytes.len()
        ));
    }
    Ok(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes))
}

/// The `webhook-signature` value for a message `id` sent at `timestamp`
/// (Unix seconds) with `body`.
pub(super) fn signature(key: &ring::hmac::Key, id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut context = ring::hmac::Context::with_key(key);
    context.update(id.as_bytes());
    context.update(b".");
    context.update(timestamp.to_string().as_bytes());
    context.update(b".");
    context.update(body);
    format!("v1,{}", STANDARD.encode(context.sign().as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_specifications_example_signs_as_published() {
        // The example of the Standard Webhooks specification (and of its
        // reference libraries' tests).
        let key = key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn a_secret_that_is_not_base64_or_too_short_is_refused_without_echo() {
        let short = key("whsec_c2hvcnQ=").unwrap_err();
        assert!(short.contains("5 bytes"), "{short}");
        let wrong = key("whsec_not base64!").unwrap_err();
        assert!(!wrong.contains("not base64!"), "{wrong}");
    }
}
