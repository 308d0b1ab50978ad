//! The subset of Stripe's search query language the simulator understands: clauses
//! `field:value` joined by `AND` or by `OR` (not both, as Stripe), `-` to negate a clause.
//! Fields: `metadata['key']` (or `metadata["key"]`), `status`, `currency`, `amount`,
//! `customer`. Strings are quoted with `'` or `"`; numbers are bare.

use super::store::PaymentIntent;

#[derive(Debug)]
enum Field {
    Metadata(String),
    Status,
    Currency,
    Amount,
    Customer,
}

#[derive(Debug)]
struct Clause {
    field: Field,
    value: String,
    negated: bool,
}

/// A parsed query.
#[derive(Debug)]
pub(crate) struct Query {
    clauses: Vec<Clause>,
    any: bool,
}

struct Cursor<'a> {
    rest: &'a str,
}

impl<'a> Cursor<'a> {
    fn skip_ws(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, prefix: &str) -> bool {
        match self.rest.strip_prefix(prefix) {
            Some(r) => {
                self.rest = r;
                true
            }
            None => false,
        }
    }

    fn word(&mut self) -> &'a str {
        let end = self
            .rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(self.rest.len());
        let (w, r) = self.rest.split_at(end);
        self.rest = r;
        w
    }

    fn quoted(&mut self) -> Result<String, String> {
        let quote = self.rest.chars().next().filter(|c| *c == '\'' || *c == '"');
        let Some(quote) = quote else {
            return Err("expected a quoted string".into());
        };
        let mut out = String::new();
        let mut chars = self.rest[1..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        out.push(e);
                    }
                }
                c if c == quote => {
                    self.rest = &self.rest[1 + i + 1..];
                    return Ok(out);
                }
                c => out.push(c),
            }
        }
        Err("unterminated string".into())
    }

    fn value(&mut self) -> Result<String, String> {
        if self.rest.starts_with(['\'', '"']) {
            self.quoted()
        } else {
            let w = self.word();
            if w.is_empty() {
                Err("expected a value".into())
            } else {
                Ok(w.to_owned())
            }
        }
    }

    fn field(&mut self) -> Result<Field, String> {
        if self.eat("metadata[") {
            let key = self.quoted()?;
            if !self.eat("]") {
                return Err("expected ] after the metadata key".into());
            }
            return Ok(Field::Metadata(key));
        }
        match self.word() {
            "status" => Ok(Field::Status),
            "currency" => Ok(Field::Currency),
            "amount" => Ok(Field::Amount),
            "customer" => Ok(Field::Customer),
            other => Err(format!(
                "Field `{other}` is an unsupported search field for resource `payment_intents`."
            )),
        }
    }
}

impl Query {
    /// Parses `query`; the error is the message of Stripe's 400.
    pub(crate) fn parse(query: &str) -> Result<Self, String> {
        let mut c = Cursor { rest: query };
        let mut clauses = Vec::new();
        let mut joiner: Option<&str> = None;
        loop {
            c.skip_ws();
            let negated = c.eat("-");
            let field = c.field()?;
            if !c.eat(":") {
                return Err("expected `:` after the field (only `:` is supported)".into());
            }
            let value = c.value()?;
            clauses.push(Clause {
                field,
                value,
                negated,
            });
            c.skip_ws();
            if c.rest.is_empty() {
                break;
            }
            let op = c.word();
            if op != "AND" && op != "OR" {
                return Err(format!("expected AND or OR, found {op:?}"));
            }
            if joiner.is_some_and(|j| j != op) {
                return Err("A query cannot mix AND and OR".into());
            }
            joiner = Some(op);
        }
        Ok(Self {
            clauses,
            any: joiner == Some("OR"),
        })
    }

    pub(crate) fn matches(&self, pi: &PaymentIntent) -> bool {
        let hit = |c: &Clause| {
            let found = match &c.field {
                Field::Metadata(k) => pi.metadata.get(k) == Some(&c.value),
                Field::Status => pi.status == c.value,
                Field::Currency => pi.currency == c.value.to_ascii_lowercase(),
                Field::Amount => c.value.parse::<u64>().ok() == Some(pi.amount),
                Field::Customer => false,
            };
            found != c.negated
        };
        if self.any {
            self.clauses.iter().any(hit)
        } else {
            self.clauses.iter().all(hit)
        }
    }
}
