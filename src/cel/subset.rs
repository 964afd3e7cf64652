//! A strict subset of the DRA CEL selector language until real CEL arrives: conjunctions of comparisons on
//! `device.driver`, `device.attributes[...]` and `device.capacity[...]`, evaluated with the scheduler's
//! rules (a missing attribute is an error, not false). Anything else is refused, never taken as true.

use std::cmp::Ordering;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

use crate::cel::quantity::Quantity;

/// A compiled selector expression.
#[derive(Debug, Clone)]
pub struct Selector {
    terms: Vec<Term>,
}

#[derive(Debug, Clone)]
enum Term {
    /// A boolean on its own: `device.attributes["d"].flag`, `true`, `....isGreaterThan(...)`.
    Bare(Operand),
    Compare(Operand, Op, Operand),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    CompareTo,
    IsGreaterThan,
    IsLessThan,
}

#[derive(Debug, Clone)]
enum Operand {
    Driver,
    Attribute {
        domain: String,
        id: String,
    },
    Capacity {
        domain: String,
        id: String,
    },
    CapacityCall {
        domain: String,
        id: String,
        method: Method,
        argument: Quantity,
    },
    Literal(Value),
}

/// The CEL values this subset deals in.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    String(String),
    Int(i64),
    Bool(bool),
    /// A `version` attribute (`kubernetes.Semver` in CEL).
    Version(String),
    Quantity(Quantity),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::String(_) => "string",
            Value::Int(_) => "int",
            Value::Bool(_) => "bool",
            Value::Version(_) => "kubernetes.Semver",
            Value::Quantity(_) => "kubernetes.Quantity",
        }
    }
}

impl Selector {
    /// Compiles `expression`, or says why it is outside the supported subset.
    pub fn compile(expression: &str) -> Result<Selector, String> {
        let tokens = lex(expression)?;
        let mut parser = Parser { tokens, next: 0 };
        let terms = parser.conjunction()?;
        if let Some(token) = parser.peek() {
            return Err(format!("unexpected {token:?} after a complete term"));
        }
        for term in &terms {
            if let Term::Bare(operand) = term {
                match operand {
                    Operand::Attribute { .. }
                    | Operand::Literal(Value::Bool(_))
                    | Operand::CapacityCall {
                        method: Method::IsGreaterThan | Method::IsLessThan,
                        ..
                    } => {}
                    other => return Err(format!("{other:?} is not a boolean")),
                }
            }
        }
        Ok(Selector { terms })
    }

    /// Evaluates the selector on a device of `driver`. `Err` is a CEL runtime error (the scheduler stops
    /// allocating on those), with CEL's error-absorbing `&&`: a false term wins over an error.
    pub fn matches(&self, driver: &str, device: &Device) -> Result<bool, String> {
        // The scheduler converts every attribute before evaluating, so one without a value breaks all
        // selectors on the device.
        for (name, attribute) in device.attributes.iter().flatten() {
            if !has_value(attribute) {
                return Err(format!("attribute {name}: unsupported attribute value"));
            }
        }
        let mut first_error = None;
        for term in &self.terms {
            match term.evaluate(driver, device) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(true),
        }
    }
}

fn has_value(attribute: &DeviceAttribute) -> bool {
    attribute.int.is_some()
        || attribute.bool.is_some()
        || attribute.string.is_some()
        || attribute.version.is_some()
        || attribute.ints.is_some()
        || attribute.bools.is_some()
        || attribute.strings.is_some()
        || attribute.versions.is_some()
}

impl Term {
    fn evaluate(&self, driver: &str, device: &Device) -> Result<bool, String> {
        match self {
            Term::Bare(operand) => match operand.value(driver, device)? {
                Value::Bool(value) => Ok(value),
                other => Err(format!(
                    "CEL result of type {} could not be converted to bool",
                    other.type_name()
                )),
            },
            Term::Compare(left, op, right) => compare(
                &left.value(driver, device)?,
                *op,
                &right.value(driver, device)?,
            ),
        }
    }
}

fn compare(left: &Value, op: Op, right: &Value) -> Result<bool, String> {
    let no_overload = || {
        Err(format!(
            "no such overload: {} {op:?} {}",
            left.type_name(),
            right.type_name()
        ))
    };
    let ordering = match (left, right) {
        (Value::String(a), Value::String(b)) => a.cmp(b),
        (Value::Int(a), Value::Int(b)) => a.cmp(b),
        (Value::Bool(a), Value::Bool(b)) => a.cmp(b),
        // Semver and Quantity have == but no ordering operators in CEL.
        (Value::Version(a), Value::Version(b)) if matches!(op, Op::Eq | Op::Ne) => a.cmp(b),
        (Value::Quantity(a), Value::Quantity(b)) if matches!(op, Op::Eq | Op::Ne) => a.cmp(b),
        (Value::Version(_) | Value::Quantity(_), _)
        | (_, Value::Version(_) | Value::Quantity(_)) => return no_overload(),
        // Heterogeneous equality of built-in types is simply false in CEL.
        _ => {
            return match op {
                Op::Eq => Ok(false),
                Op::Ne => Ok(true),
                _ => no_overload(),
            }
        }
    };
    Ok(match op {
        Op::Eq => ordering == Ordering::Equal,
        Op::Ne => ordering != Ordering::Equal,
        Op::Lt => ordering == Ordering::Less,
        Op::Le => ordering != Ordering::Greater,
        Op::Gt => ordering == Ordering::Greater,
        Op::Ge => ordering != Ordering::Less,
    })
}

impl Operand {
    fn value(&self, driver: &str, device: &Device) -> Result<Value, String> {
        match self {
            Operand::Driver => Ok(Value::String(driver.to_string())),
            Operand::Literal(value) => Ok(value.clone()),
            Operand::Attribute { domain, id } => {
                let attribute = lookup(device.attributes.as_ref(), driver, domain, id)
                    .ok_or_else(|| no_such_key(id))?;
                attribute_value(attribute).ok_or_else(|| {
                    format!(
                        "attribute {domain}/{id} is a list, which this matcher does not support"
                    )
                })
            }
            Operand::Capacity { domain, id } => {
                capacity(device, driver, domain, id).map(Value::Quantity)
            }
            Operand::CapacityCall {
                domain,
                id,
                method,
                argument,
            } => {
                let ordering = capacity(device, driver, domain, id)?.cmp(argument);
                Ok(match method {
                    Method::CompareTo => Value::Int(match ordering {
                        Ordering::Less => -1,
                        Ordering::Equal => 0,
                        Ordering::Greater => 1,
                    }),
                    Method::IsGreaterThan => Value::Bool(ordering == Ordering::Greater),
                    Method::IsLessThan => Value::Bool(ordering == Ordering::Less),
                })
            }
        }
    }
}

fn no_such_key(id: &str) -> String {
    format!(
        "no such key: {id} (consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has())"
    )
}

fn capacity(device: &Device, driver: &str, domain: &str, id: &str) -> Result<Quantity, String> {
    let capacity =
        lookup(device.capacity.as_ref(), driver, domain, id).ok_or_else(|| no_such_key(id))?;
    Quantity::parse(&capacity.value.0).map_err(|error| format!("capacity {domain}/{id}: {error}"))
}

/// Finds `domain`/`id` in a device map, where bare names belong to the driver's domain.
fn lookup<'a, T>(
    map: Option<&'a std::collections::BTreeMap<String, T>>,
    driver: &str,
    domain: &str,
    id: &str,
) -> Option<&'a T> {
    let map = map?;
    if domain == driver {
        if let Some(found) = map.get(id) {
            return Some(found);
        }
    }
    map.get(&format!("{domain}/{id}"))
}

fn attribute_value(attribute: &DeviceAttribute) -> Option<Value> {
    if let Some(value) = attribute.int {
        Some(Value::Int(value))
    } else if let Some(value) = attribute.bool {
        Some(Value::Bool(value))
    } else if let Some(value) = &attribute.string {
        Some(Value::String(value.clone()))
    } else {
        attribute.version.clone().map(Value::Version)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Int(i64),
    Dot,
    LBracket,
    RBracket,
    LParen,
    RParen,
    Minus,
    And,
    Op(Op),
}

fn lex(source: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = source.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            _ if c.is_whitespace() => i += 1,
            '.' => {
                tokens.push(Token::Dot);
                i += 1;
            }
            '[' => {
                tokens.push(Token::LBracket);
                i += 1;
            }
            ']' => {
                tokens.push(Token::RBracket);
                i += 1;
            }
            '(' => {
                tokens.push(Token::LParen);
                i += 1;
            }
            ')' => {
                tokens.push(Token::RParen);
                i += 1;
            }
            '-' => {
                tokens.push(Token::Minus);
                i += 1;
            }
            '&' if next == Some('&') => {
                tokens.push(Token::And);
                i += 2;
            }
            '=' if next == Some('=') => {
                tokens.push(Token::Op(Op::Eq));
                i += 2;
            }
            '!' if next == Some('=') => {
                tokens.push(Token::Op(Op::Ne));
                i += 2;
            }
            '<' | '>' => {
                let or_equal = next == Some('=');
                tokens.push(Token::Op(match (c, or_equal) {
                    ('<', false) => Op::Lt,
                    ('<', true) => Op::Le,
                    ('>', false) => Op::Gt,
                    _ => Op::Ge,
                }));
                i += if or_equal { 2 } else { 1 };
            }
            '"' | '\'' => {
                let (text, end) = lex_string(&chars, i)?;
                tokens.push(Token::Str(text));
                i = end;
            }
            _ if c.is_ascii_digit() => {
                let start = i;
                while i < chars.len() && chars[i].is_ascii_digit() {
                    i += 1;
                }
                if i < chars.len()
                    && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '.')
                {
                    return Err(format!(
                        "number literal at offset {start} is not a plain decimal int"
                    ));
                }
                let digits: String = chars[start..i].iter().collect();
                let value = digits
                    .parse()
                    .map_err(|_| format!("int literal {digits} is out of range"))?;
                tokens.push(Token::Int(value));
            }
            _ if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                tokens.push(Token::Ident(chars[start..i].iter().collect()));
            }
            _ => {
                let shown: String = chars[i..].iter().take(2).collect();
                return Err(format!("operator or character {shown:?} is not supported"));
            }
        }
    }
    Ok(tokens)
}

/// A quoted string starting at `start`; returns the text and the index after the closing quote.
fn lex_string(chars: &[char], start: usize) -> Result<(String, usize), String> {
    let quote = chars[start];
    if chars.get(start + 1) == Some(&quote) && chars.get(start + 2) == Some(&quote) {
        return Err("triple-quoted strings are not supported".to_string());
    }
    let mut text = String::new();
    let mut i = start + 1;
    loop {
        match chars.get(i) {
            None => return Err(format!("unterminated string at offset {start}")),
            Some(c) if *c == quote => return Ok((text, i + 1)),
            Some('\\') => {
                let escaped = match chars.get(i + 1) {
                    Some('\\') => '\\',
                    Some('"') => '"',
                    Some('\'') => '\'',
                    Some('n') => '\n',
                    Some('t') => '\t',
                    Some('r') => '\r',
                    other => return Err(format!("escape \\{other:?} is not supported")),
                };
                text.push(escaped);
                i += 2;
            }
            Some(c) => {
                text.push(*c);
                i += 1;
            }
        }
    }
}

/// Words CEL does not accept after a `.`.
const RESERVED: [&str; 21] = [
    "as",
    "break",
    "const",
    "continue",
    "else",
    "false",
    "for",
    "function",
    "if",
    "import",
    "in",
    "let",
    "loop",
    "namespace",
    "null",
    "package",
    "return",
    "true",
    "var",
    "void",
    "while",
];

struct Parser {
    tokens: Vec<Token>,
    next: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.next)
    }

    fn take(&mut self) -> Option<Token> {
        let token = self.tokens.get(self.next).cloned();
        self.next += 1;
        token
    }

    fn expect(&mut self, wanted: Token) -> Result<(), String> {
        match self.take() {
            Some(token) if token == wanted => Ok(()),
            other => Err(format!("expected {wanted:?}, found {other:?}")),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        match self.take() {
            Some(Token::Str(text)) => Ok(text),
            other => Err(format!("expected a string literal, found {other:?}")),
        }
    }

    fn ident(&mut self) -> Result<String, String> {
        match self.take() {
            Some(Token::Ident(name)) => Ok(name),
            other => Err(format!("expected a name, found {other:?}")),
        }
    }

    /// term ('&&' term)*, flattening parenthesised conjunctions.
    fn conjunction(&mut self) -> Result<Vec<Term>, String> {
        let mut terms = Vec::new();
        loop {
            if self.peek() == Some(&Token::LParen) {
                self.next += 1;
                terms.extend(self.conjunction()?);
                self.expect(Token::RParen)?;
            } else {
                terms.push(self.comparison()?);
            }
            if self.peek() == Some(&Token::And) {
                self.next += 1;
            } else {
                return Ok(terms);
            }
        }
    }

    fn comparison(&mut self) -> Result<Term, String> {
        let left = self.operand()?;
        if let Some(Token::Op(op)) = self.peek() {
            let op = *op;
            self.next += 1;
            let right = self.operand()?;
            return Ok(Term::Compare(left, op, right));
        }
        Ok(Term::Bare(left))
    }

    fn operand(&mut self) -> Result<Operand, String> {
        match self.take() {
            Some(Token::Str(text)) => Ok(Operand::Literal(Value::String(text))),
            Some(Token::Int(value)) => Ok(Operand::Literal(Value::Int(value))),
            Some(Token::Minus) => match self.take() {
                Some(Token::Int(value)) => Ok(Operand::Literal(Value::Int(-value))),
                other => Err(format!("expected an int after '-', found {other:?}")),
            },
            Some(Token::Ident(name)) => match name.as_str() {
                "true" => Ok(Operand::Literal(Value::Bool(true))),
                "false" => Ok(Operand::Literal(Value::Bool(false))),
                "quantity" => Ok(Operand::Literal(Value::Quantity(self.quantity_call()?))),
                "device" => self.device_path(),
                other => Err(format!("identifier {other} is not supported")),
            },
            other => Err(format!("expected a value, found {other:?}")),
        }
    }

    /// `("<quantity>")` after the name `quantity`.
    fn quantity_call(&mut self) -> Result<Quantity, String> {
        self.expect(Token::LParen)?;
        let text = self.string()?;
        self.expect(Token::RParen)?;
        Quantity::parse(&text).map_err(|error| error.to_string())
    }

    fn device_path(&mut self) -> Result<Operand, String> {
        self.expect(Token::Dot)?;
        let field = self.ident()?;
        if field == "driver" {
            return Ok(Operand::Driver);
        }
        if field != "attributes" && field != "capacity" {
            return Err(format!("device.{field} is not supported"));
        }
        self.expect(Token::LBracket)?;
        let domain = self.string()?;
        self.expect(Token::RBracket)?;
        let id = match self.take() {
            Some(Token::Dot) => {
                let id = self.ident()?;
                if RESERVED.contains(&id.as_str()) {
                    return Err(format!("{id} is a CEL reserved word; write [\"{id}\"]"));
                }
                id
            }
            Some(Token::LBracket) => {
                let id = self.string()?;
                self.expect(Token::RBracket)?;
                id
            }
            other => {
                return Err(format!(
                    "expected .name or [\"name\"] after the domain, found {other:?}"
                ))
            }
        };
        if self.peek() != Some(&Token::Dot) {
            return Ok(if field == "attributes" {
                Operand::Attribute { domain, id }
            } else {
                Operand::Capacity { domain, id }
            });
        }
        self.next += 1;
        let method = self.ident()?;
        let method = match (field.as_str(), method.as_str()) {
            ("capacity", "compareTo") => Method::CompareTo,
            ("capacity", "isGreaterThan") => Method::IsGreaterThan,
            ("capacity", "isLessThan") => Method::IsLessThan,
            _ => {
                return Err(format!(
                    "method or field .{method} on device.{field} is not supported"
                ))
            }
        };
        self.expect(Token::LParen)?;
        match self.ident()?.as_str() {
            "quantity" => {}
            other => return Err(format!("{method:?} takes quantity(\"...\"), not {other}")),
        }
        let argument = self.quantity_call()?;
        self.expect(Token::RParen)?;
        Ok(Operand::CapacityCall {
            domain,
            id,
            method,
            argument,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

    use super::Selector;

    const DRIVER: &str = "gpu.dra.dev";

    fn device() -> Device {
        let attributes = BTreeMap::from([
            (
                "productName".to_string(),
                DeviceAttribute {
                    string: Some("NVIDIA H100 80GB HBM3".into()),
                    ..Default::default()
                },
            ),
            (
                "minor".to_string(),
                DeviceAttribute {
                    int: Some(3),
                    ..Default::default()
                },
            ),
            (
                "mig".to_string(),
                DeviceAttribute {
                    bool: Some(false),
                    ..Default::default()
                },
            ),
            (
                "driverVersion".to_string(),
                DeviceAttribute {
                    version: Some("570.1.0".into()),
                    ..Default::default()
                },
            ),
            (
                "resource.kubernetes.io/pcieRoot".to_string(),
                DeviceAttribute {
                    string: Some("pci0000:00".into()),
                    ..Default::default()
                },
            ),
        ]);
        let capacity = BTreeMap::from([(
            "memory".to_string(),
            DeviceCapacity {
                value: K8sQuantity("80Gi".into()),
                ..Default::default()
            },
        )]);
        Device {
            name: "gpu-3".into(),
            attributes: Some(attributes),
            capacity: Some(capacity),
            ..Default::default()
        }
    }

    fn eval(expression: &str) -> Result<bool, String> {
        Selector::compile(expression)
            .unwrap_or_else(|reason| panic!("{expression}: {reason}"))
            .matches(DRIVER, &device())
    }

    #[test]
    fn supported_forms_evaluate_like_cel() {
        let cases = [
            (r#"device.driver == "gpu.dra.dev""#, true),
            (r#"device.driver != "gpu.dra.dev""#, false),
            (r#"device.driver == 'other.dev'"#, false),
            (
                r#"device.attributes["gpu.dra.dev"].productName == "NVIDIA H100 80GB HBM3""#,
                true,
            ),
            (r#"device.attributes['gpu.dra.dev'].minor == 3"#, true),
            (r#"device.attributes["gpu.dra.dev"]["minor"] != 3"#, false),
            (
                r#"device.attributes["gpu.dra.dev"].minor >= 2 && device.attributes["gpu.dra.dev"].minor < 4"#,
                true,
            ),
            (r#"device.attributes["gpu.dra.dev"].mig == false"#, true),
            (r#"device.attributes["gpu.dra.dev"].mig"#, false),
            (
                r#"device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00""#,
                true,
            ),
            // Heterogeneous equality is false, not an error.
            (r#"device.attributes["gpu.dra.dev"].minor == "3""#, false),
            (
                r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
                true,
            ),
            (
                r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("80Gi")) == 0"#,
                true,
            ),
            (
                r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("81Gi")) >= 0"#,
                false,
            ),
            (
                r#"device.capacity['gpu.dra.dev'].memory.isGreaterThan(quantity("85899345919"))"#,
                true,
            ),
            (
                r#"device.capacity["gpu.dra.dev"].memory == quantity("85899345920")"#,
                true,
            ),
            (
                r#"(device.driver == "gpu.dra.dev" && (device.attributes["gpu.dra.dev"].minor == 3))"#,
                true,
            ),
            ("true", true),
        ];
        for (expression, expected) in cases {
            assert_eq!(eval(expression), Ok(expected), "{expression}");
        }
    }

    #[test]
    fn unknown_attribute_or_capacity_is_an_error_not_false() {
        for expression in [
            r#"device.attributes["gpu.dra.dev"].nvlinkDomain == "A""#,
            r#"device.attributes["no.such.domain"].minor == 3"#,
            r#"device.capacity["gpu.dra.dev"].cores.compareTo(quantity("1")) >= 0"#,
        ] {
            let error = eval(expression).expect_err(expression);
            assert!(error.starts_with("no such key:"), "{expression}: {error}");
        }
    }

    #[test]
    fn a_false_term_absorbs_an_error_as_in_cel() {
        assert_eq!(
            eval(r#"device.attributes["gpu.dra.dev"].missing == 1 && device.driver == "x""#),
            Ok(false)
        );
        assert!(eval(
            r#"device.attributes["gpu.dra.dev"].missing == 1 && device.driver == "gpu.dra.dev""#
        )
        .is_err());
    }

    #[test]
    fn type_errors_are_runtime_errors() {
        for expression in [
            r#"device.attributes["gpu.dra.dev"].driverVersion == "570.1.0""#,
            r#"device.attributes["gpu.dra.dev"].productName"#,
            r#"device.attributes["gpu.dra.dev"].minor < "4""#,
        ] {
            assert!(eval(expression).is_err(), "{expression}");
        }
    }

    #[test]
    fn expressions_outside_the_subset_are_refused() {
        for expression in [
            "",
            r#"device.driver == "a" || device.driver == "b""#,
            r#"!(device.driver == "a")"#,
            r#"has(device.attributes["gpu.dra.dev"].minor)"#,
            r#""gpu.dra.dev" in device.attributes"#,
            r#"device.attributes["gpu.dra.dev"].?minor.orValue(0) == 3"#,
            r#"device.attributes["gpu.dra.dev"].productName.startsWith("NVIDIA")"#,
            r#"device.allowMultipleAllocations"#,
            r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi"))"#,
            r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40GB")) >= 0"#,
            r#"device.attributes["gpu.dra.dev"].minor == 3.0"#,
            r#"device.driver"#,
            r#"device.driver == """x""""#,
            r#"cel.bind(x, device.attributes["gpu.dra.dev"], x.minor == 3)"#,
            r#"device.attributes["gpu.dra.dev"].namespace == "a""#,
        ] {
            assert!(
                Selector::compile(expression).is_err(),
                "{expression:?} was accepted"
            );
        }
    }

    #[test]
    fn an_attribute_without_value_breaks_every_selector_on_the_device() {
        let mut broken = device();
        if let Some(attributes) = broken.attributes.as_mut() {
            attributes.insert("empty".into(), DeviceAttribute::default());
        }
        let selector = Selector::compile(r#"device.driver == "gpu.dra.dev""#).expect("compiles");
        assert!(selector.matches(DRIVER, &broken).is_err());
    }
}
