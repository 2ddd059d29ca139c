//! PLACEHOLDER: replaced by the SWIM membership core.
use serde::{Deserialize, Serialize};
/// Membership messages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// placeholder
    Ping(u64),
}
