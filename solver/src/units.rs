//! Byte sizes as people write them: `67108864`, `64MiB`, `64 MiB`, `1.5GiB`, `512K`.

/// Parses a size in bytes. Accepts a plain number of bytes or a number with a binary suffix
/// (`KiB`, `MiB`, `GiB`, `TiB`, or the short `K`, `M`, `G`, `T`; `B` for bytes), any case.
/// Decimal suffixes (`MB`) are refused as ambiguous.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        "kb" | "mb" | "gb" | "tb" => {
            return Err(format!(
                "`{text}`: decimal suffixes are ambiguous; write {}iB (powers of 1024) or a number of bytes",
                suffix.trim()[..1].to_ascii_uppercase()
            ))
        }
        other => return Err(format!("`{text}`: unknown size suffix `{other}` (use bytes, KiB, MiB, GiB or TiB)")),
    };
    if number.is_empty() {
        return Err(format!(
            "`{text}`: expected a number of bytes, optionally with KiB/MiB/GiB"
        ));
    }
    let scale = (1u64 << shift) as f64;
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(1u64 << shift)
            .ok_or_else(|| format!("`{text}` is too large"));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}`: `{number}` is not a number"))?;
    let bytes = (value * scale).round();
    if !(bytes.is_finite() && bytes < u64::MAX as f64) {
        return Err(format!("`{text}` is too large"));
    }
    Ok(bytes as u64)
}

/// Human form with a binary unit: `0 B`, `1023 B`, `4.2 MiB`, `64 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("67108864"), Ok(64 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("64 mib"), Ok(64 << 20));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("8KiB"), Ok(8192));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("12B"), Ok(12));
        assert!(parse_size("64MB").unwrap_err().contains("MiB"));
        assert!(parse_size("-1").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("1.2.3MiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert!(parse_size("64 furlongs").unwrap_err().contains("furlongs"));
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(64 << 20), "64 MiB");
        assert_eq!(format_bytes(4392300), "4.2 MiB");
    }
}
