//! Enums stored as one word per value ([`stored_words!`](crate::stored_words)), and the
//! error of a word that names none.

/// A stored word that names no value of the enum it was read as (a corrupt row, or a row
/// written by a newer version).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {word:?}")]
pub struct UnknownWord {
    /// The enum's name, e.g. `OutboxState`.
    pub kind: &'static str,
    /// The word read.
    pub word: String,
}

/// Declares an enum stored as one word per value (a `state` or `kind` column): the enum
/// with the attributes given (derives, `#[non_exhaustive]`), `ALL` (every value in
/// declaration order), `as_str` (the stored word), `parse` (the value a word names, or
/// [`UnknownWord`]) and `Display` (the word).
///
/// ```
/// oncely_core::stored_words! {
///     /// A light.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Light {
///         /// Stop.
///         Red => "red",
///         /// Go.
///         Green => "green",
///     }
/// }
/// assert_eq!(Light::parse("green"), Ok(Light::Green));
/// assert_eq!(Light::Red.to_string(), "red");
/// assert!(Light::parse("blue").is_err());
/// ```
#[macro_export]
macro_rules! stored_words {
    ($(#[$m:meta])* $vis:vis enum $name:ident {
        $($(#[$vm:meta])* $v:ident => $w:literal),* $(,)?
    }) => {
        $(#[$m])*
        $vis enum $name {
            $($(#[$vm])* $v),*
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$v),*];

            /// The stored word.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$v => $w),*
                }
            }

            /// The value a stored word names.
            ///
            /// # Errors
            /// `oncely_core::UnknownWord` for another word.
            pub fn parse(s: &str) -> Result<Self, $crate::UnknownWord> {
                match s {
                    $($w => Ok(Self::$v),)*
                    _ => Err($crate::UnknownWord {
                        kind: stringify!($name),
                        word: s.to_owned(),
                    }),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
