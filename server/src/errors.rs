//! OpenAI-style error responses.
//!
//! Every failure the server reports, whatever produced it (a handler, an extractor, the body
//! limit, a panic), reaches the client as `{"error":{"message","type","param","code"}}` with the
//! matching status, because OpenAI's clients parse that shape to raise a useful exception.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::backend::SubmitError;

/// How long a client should wait while the model loads before it asks again.
const LOADING_RETRY_AFTER_S: u64 = 5;

/// An error answer: a status and the body OpenAI's clients expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error` for client mistakes, `server_error` otherwise.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503 only).
    pub retry_after_s: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

/// The inner object; also sent alone as an SSE `data: {"error":…}` event.
#[derive(Serialize)]
pub(crate) struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// 400: the request is malformed or a field is invalid; `param` names the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.into());
        e
    }

    /// 400 without a particular field (for example malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    /// 401 `invalid_api_key`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message);
        e.code = Some("invalid_api_key");
        e
    }

    /// 503 while the model loads; the client may retry shortly.
    pub fn loading() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model is still loading",
        );
        e.code = Some("model_loading");
        e.retry_after_s = Some(LOADING_RETRY_AFTER_S);
        e
    }

    /// 503 once the server has begun shutting down.
    pub fn shutting_down() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down",
        );
        e.code = Some("shutting_down");
        e
    }

    /// 500: something broke on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The error for a bare status produced outside the handlers (axum's 405, tower-http's 413,
    /// ...), so those too carry a JSON body.
    pub fn for_status(status: StatusCode, method: &str, path: &str) -> Self {
        let (kind, message, code) = match status {
            StatusCode::NOT_FOUND => ("invalid_request_error", format!("Invalid URL ({method} {path})"), None),
            StatusCode::METHOD_NOT_ALLOWED => (
                "invalid_request_error",
                format!("Method {method} is not allowed for {path}"),
                None,
            ),
            StatusCode::PAYLOAD_TOO_LARGE => (
                "invalid_request_error",
                "The request body is larger than the server accepts".to_string(),
                Some("request_too_large"),
            ),
            s if s.is_server_error() => ("server_error", format!("The server failed: {s}"), None),
            s => ("invalid_request_error", format!("The request failed: {s}"), None),
        };
        let mut e = Self::new(status, kind, message);
        e.code = code;
        e
    }

    /// The body object alone, for an SSE error event.
    pub(crate) fn detail(&self) -> ErrorDetail<'_> {
        ErrorDetail {
            message: &self.message,
            kind: self.kind,
            param: self.param.as_deref(),
            code: self.code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: self.detail() };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::BadRequest { message, param } => {
                let mut err = ApiError::bad_request(message);
                err.param = param;
                err
            }
            SubmitError::ContextExceeded { prompt_tokens, ctx } => {
                let mut err = ApiError::bad_request(format!(
                    "This model's maximum context length is {ctx} tokens. However, your request has \
                     {prompt_tokens} prompt tokens. Please reduce the length of the prompt."
                ));
                err.code = Some("context_length_exceeded");
                err
            }
            SubmitError::QueueFull { retry_after_s } => {
                let mut err = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "The server is busy with other requests; retry shortly",
                );
                err.code = Some("server_overloaded");
                err.retry_after_s = Some(retry_after_s);
                err
            }
            SubmitError::ShuttingDown => ApiError::shutting_down(),
        }
    }
}

impl From<JsonRejection> for ApiError {
    /// Malformed JSON and a wrong Content-Type are 400 (not axum's 415/422); a body over the limit
    /// stays 413.
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::MissingJsonContentType(_) => {
                ApiError::bad_request("The request needs the header `Content-Type: application/json`")
            }
            r if r.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::for_status(r.status(), "", ""),
            r => ApiError::bad_request(format!("The body is not valid JSON: {}", r.body_text())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves ContextExceeded maps to 400 with the OpenAI code and both numbers in the message.
    #[test]
    fn context_exceeded_names_both_numbers() {
        let e = ApiError::from(SubmitError::ContextExceeded {
            prompt_tokens: 5000,
            ctx: 4096,
        });
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(
            e.message.contains("5000") && e.message.contains("4096"),
            "{}",
            e.message
        );
    }

    // Proves QueueFull becomes 503 with a Retry-After header carrying the backend's delay.
    #[test]
    fn queue_full_sets_retry_after() {
        let response = ApiError::from(SubmitError::QueueFull { retry_after_s: 7 }).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "7");
    }

    // Proves the detail serialises with OpenAI's field names, nulls included.
    #[test]
    fn detail_has_openai_fields() {
        let e = ApiError::invalid("temperature", "bad");
        let v = serde_json::to_value(e.detail()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"message":"bad","type":"invalid_request_error","param":"temperature","code":null})
        );
    }
}
