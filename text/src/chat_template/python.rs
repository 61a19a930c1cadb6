//! The pieces of Python's behaviour that chat templates see through Jinja2 and `transformers`:
//! `str(x)` for printed values, `str.strip` and friends (Python's idea of whitespace),
//! `json.dumps` as `transformers` wires it into `tojson`, and `datetime.now().strftime`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind, State, Value};

/// `str.isspace()` for one character (Python 3: bidirectional class WS, B or S, or Zs).
pub(crate) fn is_py_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n'
            | '\x0b'
            | '\x0c'
            | '\r'
            | '\x1c'..='\x1f'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

#[derive(Clone, Copy)]
pub(crate) enum Side {
    Both,
    Start,
    End,
}

/// `str.strip(chars)`, `str.lstrip(chars)`, `str.rstrip(chars)`: `chars = None` strips
/// Python whitespace, otherwise every character of `chars`.
pub(crate) fn py_strip<'a>(s: &'a str, chars: Option<&str>, side: Side) -> &'a str {
    let set: Vec<char> = chars.map(|c| c.chars().collect()).unwrap_or_default();
    let strip = |c: char| match chars {
        None => is_py_space(c),
        Some(_) => set.contains(&c),
    };
    match side {
        Side::Both => s.trim_matches(strip),
        Side::Start => s.trim_start_matches(strip),
        Side::End => s.trim_end_matches(strip),
    }
}

/// Reads the optional `chars` argument of the strip family (a string or `None`).
fn strip_chars(args: &[Value]) -> Result<Option<String>, Error> {
    match args {
        [] => Ok(None),
        [v] if v.is_none() => Ok(None),
        [v] => match v.as_str() {
            Some(s) => Ok(Some(s.to_owned())),
            None => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("strip arg must be None or str, not {}", v.kind()),
            )),
        },
        _ => Err(Error::from(ErrorKind::TooManyArguments)),
    }
}

/// The unknown-method callback: Python's `str.strip`/`lstrip`/`rstrip` with Python's whitespace,
/// everything else from `minijinja_contrib::pycompat` (`startswith`, `split`, `items`, `get`...).
pub(crate) fn unknown_method(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let side = match method {
            "strip" => Some(Side::Both),
            "lstrip" => Some(Side::Start),
            "rstrip" => Some(Side::End),
            _ => None,
        };
        if let Some(side) = side {
            let chars = strip_chars(args)?;
            return Ok(Value::from(py_strip(s, chars.as_deref(), side)));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The `trim` filter as Jinja2 has it: `str(value).strip(chars)`.
pub(crate) fn trim_filter(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    let s = py_str(value);
    let chars = match chars {
        None => None,
        Some(c) if c.is_none() => None,
        Some(c) => Some(py_str(&c)),
    };
    Ok(Value::from(py_strip(&s, chars.as_deref(), Side::Both)))
}

/// The `string` filter: `str(value)` (strings stay as they are).
pub(crate) fn string_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        value.clone()
    } else {
        Value::from(py_str(value))
    }
}

/// Python's `repr(float)` (shortest round-trip digits, exponent outside `1e-4 <= |x| < 1e16`).
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is a number");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let decpt = exp + 1;
    if !(-4 < decpt && decpt <= 16) {
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{esign}{:02}", exp.unsigned_abs());
    }
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let body = if decpt <= 0 {
        format!("0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        let (a, b) = digits.split_at(decpt as usize);
        format!("{a}.{b}")
    };
    format!("{sign}{body}")
}

/// Python's `repr(str)`.
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn py_repr_into(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() { ('(', ')') } else { ('[', ']') };
            out.push(open);
            let mut n = 0;
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr_into(&item, out);
                    n += 1;
                }
            }
            if n == 1 && open == '(' {
                out.push(',');
            }
            out.push(close);
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr_into(&key, out);
                    out.push_str(": ");
                    py_repr_into(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&py_str(value)),
    }
}

/// Python's `str(value)` for the values a template handles; what `{{ value }}` prints.
pub(crate) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => value.to_string(),
        },
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            py_repr_into(value, &mut out);
            out
        }
        _ => value.to_string(),
    }
}

/// `json.dumps(x, ensure_ascii=..., indent=..., separators=..., sort_keys=...)`, the `tojson`
/// filter `transformers` installs (`ensure_ascii=False` by default, unlike Jinja2's own).
struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

pub(crate) fn tojson_filter(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut params: [Option<Value>; 4] = Default::default();
    let mut positional = 0;
    for arg in args.into_values() {
        if arg.is_kwargs() {
            let kwargs = Kwargs::try_from(arg)?;
            for (i, name) in NAMES.iter().enumerate() {
                if let Some(v) = kwargs.get::<Option<Value>>(name)? {
                    params[i] = Some(v);
                }
            }
            kwargs.assert_all_used()?;
        } else {
            if positional >= NAMES.len() {
                return Err(Error::from(ErrorKind::TooManyArguments));
            }
            params[positional] = Some(arg);
            positional += 1;
        }
    }
    let [ensure_ascii, indent, separators, sort_keys] = params;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            // `' ' * indent`, where a bool counts as 0 or 1 and a negative number as 0.
            None => {
                let n = if v.kind() == ValueKind::Bool {
                    v.is_true() as i64
                } else {
                    i64::try_from(v.clone()).map_err(|_| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            format!("tojson: indent must be an integer or a string, not {}", v.kind()),
                        )
                    })?
                };
                " ".repeat(n.max(0) as usize)
            }
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (py_str(a), py_str(b)),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        py_float_repr(f)
    }
}

fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: object of type {} is not JSON serializable", value.kind()),
    )
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers, bools and None as text.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::None => "null".into(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => json_float(f64::try_from(key.clone())?),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {}", key.kind()),
            ));
        }
    })
}

fn newline_indent(opts: &JsonOptions, depth: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_json(value: &Value, opts: &JsonOptions, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > 500 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&json_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_json_str(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                write_json(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                write_json_str(key, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                write_json(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push('}');
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// A wall-clock time without a zone, like Python's naive `datetime.now()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DateTime {
    pub year: i32,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub microsecond: u32,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

impl DateTime {
    /// The local time now (`datetime.now()`), from the C library's `localtime_r`.
    pub fn now() -> DateTime {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let secs = since_epoch.as_secs() as libc::time_t;
        // SAFETY: `tm` is plain C data, for which all zero bytes is a valid value.
        let mut tm: libc::tm = unsafe { std::mem::zeroed() };
        // SAFETY: `localtime_r` only reads `secs` and writes the `tm` we hand it.
        let ok = unsafe { !libc::localtime_r(&secs, &mut tm).is_null() };
        if !ok {
            return DateTime::from_unix_utc(secs as i64, since_epoch.subsec_micros());
        }
        DateTime {
            year: tm.tm_year + 1900,
            month: (tm.tm_mon + 1) as u32,
            day: tm.tm_mday as u32,
            hour: tm.tm_hour as u32,
            minute: tm.tm_min as u32,
            second: tm.tm_sec as u32,
            microsecond: since_epoch.subsec_micros(),
        }
    }

    fn from_unix_utc(secs: i64, microsecond: u32) -> DateTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // `civil_from_days`, the inverse of `days_from_civil`.
        let z = days + 719_468;
        let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        DateTime {
            year: year as i32,
            month: month as u32,
            day: day as u32,
            hour: (rem / 3600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            microsecond,
        }
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS[.ffffff]` (also with a space for the `T`), as Python's
    /// `datetime.isoformat()` writes a naive time.
    pub fn parse_iso(s: &str) -> Option<DateTime> {
        let (date, time) = s.split_once(['T', ' '])?;
        let mut d = date.splitn(3, '-');
        let year = d.next()?.parse().ok()?;
        let month = d.next()?.parse().ok()?;
        let day = d.next()?.parse().ok()?;
        let (hms, frac) = match time.split_once('.') {
            Some((hms, frac)) => (hms, Some(frac)),
            None => (time, None),
        };
        let mut t = hms.splitn(3, ':');
        let hour = t.next()?.parse().ok()?;
        let minute = t.next()?.parse().ok()?;
        let second = t.next()?.parse().ok()?;
        let microsecond = match frac {
            Some(f) if f.len() <= 6 && f.bytes().all(|b| b.is_ascii_digit()) => format!("{f:0<6}").parse().ok()?,
            Some(_) => return None,
            None => 0,
        };
        let dt = DateTime {
            year,
            month,
            day,
            hour,
            minute,
            second,
            microsecond,
        };
        dt.is_valid().then_some(dt)
    }

    fn is_valid(&self) -> bool {
        let leap = (self.year % 4 == 0 && self.year % 100 != 0) || self.year % 400 == 0;
        let days_in_month = match self.month {
            1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
            4 | 6 | 9 | 11 => 30,
            2 if leap => 29,
            2 => 28,
            _ => return false,
        };
        (1..=days_in_month).contains(&self.day)
            && self.hour < 24
            && self.minute < 60
            && self.second < 60
            && self.microsecond < 1_000_000
    }

    /// `datetime.strftime(format)`: `%f` is the microseconds, `%z` and `%Z` are empty (a naive
    /// time), everything else goes to the C library's `strftime`, as CPython does.
    pub fn strftime(&self, format: &str) -> Result<String, String> {
        if !self.is_valid() {
            return Err(format!("invalid date/time {self:?}"));
        }
        let mut fmt = String::with_capacity(format.len() + 1);
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                fmt.push(c);
                continue;
            }
            match chars.next() {
                Some('f') => {
                    let _ = write!(fmt, "{:06}", self.microsecond);
                }
                Some('z' | 'Z') => {}
                Some(other) => {
                    fmt.push('%');
                    fmt.push(other);
                }
                None => fmt.push('%'),
            }
        }
        let days = days_from_civil(i64::from(self.year), i64::from(self.month), i64::from(self.day));
        let yday = days - days_from_civil(i64::from(self.year), 1, 1);
        // SAFETY: an all-zero `tm` is valid (null `tm_zone`); every field used is set below.
        let mut tm: libc::tm = unsafe { std::mem::zeroed() };
        tm.tm_year = self.year - 1900;
        tm.tm_mon = self.month as i32 - 1;
        tm.tm_mday = self.day as i32;
        tm.tm_hour = self.hour as i32;
        tm.tm_min = self.minute as i32;
        tm.tm_sec = self.second as i32;
        tm.tm_wday = (days + 4).rem_euclid(7) as i32; // 1970-01-01 was a Thursday
        tm.tm_yday = yday as i32;
        tm.tm_isdst = -1;
        // A trailing character tells an empty result from a buffer that was too small.
        fmt.push(' ');
        let cfmt = std::ffi::CString::new(fmt).map_err(|_| "strftime format contains a NUL character".to_owned())?;
        let mut cap = 256usize;
        loop {
            let mut buf = vec![0u8; cap];
            // SAFETY: `buf` has `cap` writable bytes, `cfmt` is NUL-terminated and `tm` is valid.
            let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), cap, cfmt.as_ptr(), &tm) };
            if n > 0 {
                buf.truncate(n - 1);
                return String::from_utf8(buf).map_err(|_| "strftime produced invalid UTF-8".to_owned());
            }
            if cap > 1 << 20 {
                return Err("strftime result too long".to_owned());
            }
            cap *= 4;
        }
    }
}
