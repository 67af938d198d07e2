//! Network files: a TOML list of convolution layers, for `mucudnn tune --network FILE.toml`.
//!
//! Text enters (with the batch size, dtype and layout the caller chose, as for a zoo model) and
//! leaves as a [`Network`]: the same [`ModelLayer`]s the model zoo produces, identical shapes
//! merged with their counts added, so profiling and reports treat a file like a zoo model.
//! The format is documented in `docs/NETWORK_FORMAT.md`:
//!
//! ```toml
//! name = "mynet"          # optional: prefix of every layer name (`mynet.conv1`)
//!
//! [[layer]]
//! name = "conv1"          # required, unique
//! in_channels = 3         # required: C
//! out_channels = 64       # required: K
//! input = [224, 224]      # required: [H, W] (2-D), [D, H, W] (3-D), [W] (1-D); one number
//!                         # is a square 2-D input
//! depth = 16              # optional: makes a 2-D `input` the frames of a 3-D one
//! kernel = 7              # required: one value per axis ([T, R, S] in 3-D), or one number
//! stride = 2              # one value per axis or one number; default 1
//! padding = 3             # one value per axis or one number; default 0
//! dilation = 1            # one value per axis or one number; default 1
//! groups = 1              # default 1 (depthwise: groups = in_channels = out_channels)
//! transposed = false      # a ConvTranspose layer: tuned as the convolution it is the
//! output_padding = 0      # backward-data of (its output padding, default 0)
//! count = 1               # how many layers of the network have this shape; default 1
//! ```
//!
//! Every mistake is an error value, never a panic, and names the 1-based line and the field:
//! TOML syntax, unknown fields (a typo such as `kernal`), wrong types, missing fields, values
//! that do not make a convolution (checked field by field, then by
//! [`ConvProblem::validate`]), and duplicate layer names.
//!
//! Parsing goes through `toml`'s spanned document tree ([`toml::de::DeTable`]) rather than
//! straight into serde structs, so that every error knows which layer it is in and which key
//! is at fault; each layer table is then deserialised on its own (`deny_unknown_fields` backs
//! up the explicit key check).

use crate::models::{dedup, ModelLayer};
use crate::solver::{ConvProblem, DType, Layout, ShapeError};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

/// The layers of a network file at one batch size, dtype and layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Network {
    /// The file's `name`, if it has one (already prefixed to every layer name).
    pub name: Option<String>,
    /// Distinct layers in file order; a shape that appears in several layers is listed once,
    /// under its first layer's name, with the counts added.
    pub layers: Vec<ModelLayer>,
}

impl Network {
    /// Convolutions in the network, counting multiplicity.
    pub fn convolutions(&self) -> u64 {
        self.layers.iter().map(|l| u64::from(l.count)).sum()
    }
}

/// Why a network file cannot be used. Lines are 1-based.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("cannot read network file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Any other error, with the file it came from.
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        source: Box<NetworkError>,
    },
    #[error("batch size must be positive, got {batch}")]
    BadBatch { batch: i64 },
    #[error("line {line}: TOML syntax error: {message}")]
    Syntax { line: usize, message: String },
    /// `where_` is `in layer N` or `at the top level`.
    #[error("line {line}: unknown field `{field}` {where_} (expected one of {expected})")]
    UnknownField {
        line: usize,
        field: String,
        where_: String,
        expected: String,
    },
    #[error("line {line}: {layer}: missing field `{field}`")]
    MissingField {
        line: usize,
        layer: LayerRef,
        field: &'static str,
    },
    /// A value of the wrong type (`where_` is a layer or `the top level`).
    #[error("line {line}: {where_}: field `{field}`: {message}")]
    WrongType {
        line: usize,
        where_: String,
        field: String,
        message: String,
    },
    /// A value of the right type that does not make a convolution.
    #[error("line {line}: {layer}: field `{field}`: {message}")]
    InvalidLayer {
        line: usize,
        layer: LayerRef,
        field: &'static str,
        message: String,
    },
    #[error(
        "line {line}: {layer}: the name `{name}` is already used by layer {first_index} (line {first_line})"
    )]
    DuplicateName {
        line: usize,
        layer: LayerRef,
        name: String,
        first_index: usize,
        first_line: usize,
    },
    #[error("the network has no layers: add [[layer]] tables")]
    NoLayers,
}

impl NetworkError {
    /// The 1-based line the error is about, when it is about one.
    pub fn line(&self) -> Option<usize> {
        match self {
            NetworkError::Read { .. } | NetworkError::BadBatch { .. } | NetworkError::NoLayers => {
                None
            }
            NetworkError::InFile { source, .. } => source.line(),
            NetworkError::Syntax { line, .. }
            | NetworkError::UnknownField { line, .. }
            | NetworkError::MissingField { line, .. }
            | NetworkError::WrongType { line, .. }
            | NetworkError::InvalidLayer { line, .. }
            | NetworkError::DuplicateName { line, .. } => Some(*line),
        }
    }
}

/// A layer in messages: `layer 2 `conv2`` (1-based, in file order), its name when known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRef {
    pub index: usize,
    pub name: Option<String>,
}

impl fmt::Display for LayerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {}", self.index)?;
        if let Some(name) = &self.name {
            // As written in the file, but one line: a name with control characters is
            // refused, and the message naming it must not carry them to the terminal.
            write!(f, " `{}`", crate::report::escape_control(name))?;
        }
        Ok(())
    }
}

const TOP_LEVEL_FIELDS: [&str; 2] = ["name", "layer"];
const LAYER_FIELDS: [&str; 13] = [
    "name",
    "in_channels",
    "out_channels",
    "input",
    "depth",
    "kernel",
    "stride",
    "padding",
    "dilation",
    "groups",
    "transposed",
    "output_padding",
    "count",
];
const REQUIRED_LAYER_FIELDS: [&str; 5] = ["name", "in_channels", "out_channels", "input", "kernel"];

/// One `[[layer]]` table as written (before any check beyond types).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerSpec {
    name: String,
    in_channels: Int,
    out_channels: Int,
    input: Dims,
    #[serde(default)]
    depth: Option<Int>,
    kernel: Dims,
    #[serde(default)]
    stride: Option<Dims>,
    #[serde(default)]
    padding: Option<Dims>,
    #[serde(default)]
    dilation: Option<Dims>,
    #[serde(default)]
    groups: Option<Int>,
    #[serde(default)]
    transposed: Option<bool>,
    #[serde(default)]
    output_padding: Option<Dims>,
    #[serde(default)]
    count: Option<Int>,
}

/// An integer; its own type only so that a wrong value's message says "expected an integer"
/// rather than serde's "expected i64".
#[derive(Clone, Copy, Debug, PartialEq)]
struct Int(i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Int, E> {
                Ok(Int(value))
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Int, E> {
                i64::try_from(value)
                    .map(Int)
                    .map_err(|_| E::custom(format!("{value} is too large")))
            }
        }
        deserializer.deserialize_any(IntVisitor)
    }
}

/// Per-axis values: one integer (the same on every axis of the layer) or an array of one to
/// three integers, one per spatial axis (`[w]`, `[h, w]`, `[d, h, w]`).
#[derive(Clone, Debug, PartialEq)]
enum Dims {
    Same(i64),
    Axes(Vec<i64>),
}

impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DimsVisitor;
        impl<'de> Visitor<'de> for DimsVisitor {
            type Value = Dims;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer or an array of one to three integers")
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Dims, E> {
                Ok(Dims::Same(value))
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Dims, E> {
                i64::try_from(value)
                    .map(Dims::Same)
                    .map_err(|_| E::custom(format!("{value} is too large")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
                let mut values = Vec::new();
                while let Some(Int(value)) = seq.next_element()? {
                    if values.len() == 3 {
                        return Err(de::Error::invalid_length(4, &self));
                    }
                    values.push(value);
                }
                if values.is_empty() {
                    return Err(de::Error::invalid_length(0, &self));
                }
                Ok(Dims::Axes(values))
            }
        }
        deserializer.deserialize_any(DimsVisitor)
    }
}

impl Dims {
    /// `[d, h, w]` for a layer of `rank` spatial axes, the axes it lacks at `neutral`; an array
    /// must have one value per axis.
    fn axes(
        &self,
        field: &'static str,
        rank: usize,
        neutral: i64,
    ) -> Result<[i64; 3], (&'static str, String)> {
        let given: Vec<i64> = match self {
            Dims::Same(value) => vec![*value; rank],
            Dims::Axes(values) if values.len() == rank => values.clone(),
            Dims::Axes(values) => {
                return Err((
                    field,
                    format!(
                        "{} values for a {rank}-D layer, which takes {rank} ({}) or one number",
                        values.len(),
                        ["[w]", "[h, w]", "[d, h, w]"][rank - 1]
                    ),
                ))
            }
        };
        let mut all = [neutral; 3];
        all[3 - rank..].copy_from_slice(&given);
        Ok(all)
    }
}

/// Reads and parses a network file; errors name the file.
pub fn read_network(
    path: &Path,
    batch: i64,
    dtype: DType,
    layout: Layout,
) -> Result<Network, NetworkError> {
    let text = std::fs::read_to_string(path).map_err(|source| NetworkError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_network(&text, batch, dtype, layout).map_err(|source| NetworkError::InFile {
        path: path.to_path_buf(),
        source: Box::new(source),
    })
}

/// Parses a network file's text into its distinct layers at batch size `batch`.
pub fn parse_network(
    text: &str,
    batch: i64,
    dtype: DType,
    layout: Layout,
) -> Result<Network, NetworkError> {
    if batch < 1 {
        return Err(NetworkError::BadBatch { batch });
    }
    let lines = LineIndex::new(text);
    let root = DeTable::parse(text).map_err(|err| NetworkError::Syntax {
        line: lines.line(err.span().map_or(0, |s| s.start)),
        message: err.message().to_string(),
    })?;
    let root = root.get_ref();
    if let Some((key, _)) = first_unknown(root, &TOP_LEVEL_FIELDS) {
        return Err(NetworkError::UnknownField {
            line: lines.line(key.span().start),
            field: key.get_ref().to_string(),
            where_: "at the top level".into(),
            expected: expected_list(&TOP_LEVEL_FIELDS),
        });
    }
    let prefix = match root.get("name") {
        None => None,
        Some(value) => {
            let line = lines.line(value.span().start);
            let wrong = |message: String| NetworkError::WrongType {
                line,
                where_: "the top level".into(),
                field: "name".into(),
                message,
            };
            let name = value
                .get_ref()
                .as_str()
                .ok_or_else(|| wrong(format!("expected a string, found {}", type_name(value))))?;
            check_name(name).map_err(wrong)?;
            Some(name.to_string())
        }
    };
    let items: &[Spanned<DeValue<'_>>] = match root.get("layer") {
        None => return Err(NetworkError::NoLayers),
        Some(value) => match value.get_ref().as_array() {
            Some(array) => array.as_ref(),
            None => {
                return Err(NetworkError::WrongType {
                    line: lines.line(value.span().start),
                    where_: "the top level".into(),
                    field: "layer".into(),
                    message: format!(
                        "expected an array of tables (write `[[layer]]`, not `[layer]`), found {}",
                        type_name(value)
                    ),
                })
            }
        },
    };
    if items.is_empty() {
        return Err(NetworkError::NoLayers);
    }
    let mut layers = Vec::with_capacity(items.len());
    // Name -> (layer index, line), to point a duplicate at its first use.
    let mut seen: HashMap<String, (usize, usize)> = HashMap::new();
    for (position, item) in items.iter().enumerate() {
        let index = position + 1;
        let header_line = lines.line(item.span().start);
        let Some(table) = item.get_ref().as_table() else {
            return Err(NetworkError::WrongType {
                line: header_line,
                where_: format!("layer {index}"),
                field: "layer".into(),
                message: format!("expected a table, found {}", type_name(item)),
            });
        };
        let layer = LayerRef {
            index,
            name: table
                .get("name")
                .and_then(|v| v.get_ref().as_str())
                .map(str::to_string),
        };
        let field_line = |field: &str| {
            table
                .get(field)
                .map_or(header_line, |value| lines.line(value.span().start))
        };
        if let Some((key, _)) = first_unknown(table, &LAYER_FIELDS) {
            return Err(NetworkError::UnknownField {
                line: lines.line(key.span().start),
                field: key.get_ref().to_string(),
                where_: format!("in layer {index}"),
                expected: expected_list(&LAYER_FIELDS),
            });
        }
        if let Some(field) = REQUIRED_LAYER_FIELDS
            .into_iter()
            .find(|field| table.get(*field).is_none())
        {
            return Err(NetworkError::MissingField {
                line: header_line,
                layer,
                field,
            });
        }
        let spec =
            LayerSpec::deserialize(ValueDeserializer::from(item.clone())).map_err(|err| {
                // The error's span lies in the value at fault; find its key.
                let at = err.span().map_or(item.span().start, |s| s.start);
                let field = table
                    .iter()
                    .find(|(_, value)| contains(&value.span(), at))
                    .map_or_else(|| "?".to_string(), |(key, _)| key.get_ref().to_string());
                NetworkError::WrongType {
                    line: lines.line(at),
                    where_: layer.to_string(),
                    field,
                    message: err.message().to_string(),
                }
            })?;
        let invalid = |field: &'static str, message: String| NetworkError::InvalidLayer {
            line: field_line(field),
            layer: layer.clone(),
            field,
            message,
        };
        check_name(&spec.name).map_err(|message| invalid("name", message))?;
        let name = match &prefix {
            Some(prefix) => format!("{prefix}.{}", spec.name),
            None => spec.name.clone(),
        };
        let name_line = field_line("name");
        if let Some(&(first_index, first_line)) = seen.get(&name) {
            return Err(NetworkError::DuplicateName {
                line: name_line,
                layer,
                name,
                first_index,
                first_line,
            });
        }
        seen.insert(name.clone(), (index, name_line));
        let problem = layer_problem(&spec, batch, dtype, layout)
            .map_err(|(field, message)| invalid(field, message))?;
        let count = spec.count.map_or(1, |Int(c)| c);
        let count = match u32::try_from(count) {
            Ok(count) if count >= 1 => count,
            _ if count > 0 => {
                return Err(invalid(
                    "count",
                    format!("{count} is too large (at most {})", u32::MAX),
                ))
            }
            _ => return Err(invalid("count", format!("must be at least 1, got {count}"))),
        };
        layers.push(ModelLayer {
            name,
            problem,
            count,
        });
    }
    dedup(&mut layers);
    Ok(Network {
        name: prefix,
        layers,
    })
}

/// The convolution a layer describes, or the field at fault and why. A transposed layer is
/// the convolution whose backward-data it is (docs/NETWORK_FORMAT.md, "Transposed layers").
fn layer_problem(
    spec: &LayerSpec,
    batch: i64,
    dtype: DType,
    layout: Layout,
) -> Result<ConvProblem, (&'static str, String)> {
    // The rank: the number of `input` values (one number is a square 2-D input), 3 with `depth`.
    let (input, rank) = match (&spec.input, spec.depth) {
        (Dims::Same(size), None) => ([1, *size, *size], 2),
        (Dims::Axes(values), None) => {
            let rank = values.len();
            (spec.input.axes("input", rank, 1)?, rank)
        }
        (Dims::Same(_) | Dims::Axes(_), Some(Int(depth))) => {
            if matches!(&spec.input, Dims::Axes(values) if values.len() != 2) {
                return Err((
                    "depth",
                    "`depth` goes with a two-value `input` ([h, w]) or one number; \
                     a three-value `input` already has the depth"
                        .into(),
                ));
            }
            let [_, h, w] = spec.input.axes("input", 2, 1)?;
            ([depth, h, w], 3)
        }
    };
    let kernel = spec.kernel.axes("kernel", rank, 1)?;
    let same = |v: i64| Dims::Same(v);
    let stride = spec
        .stride
        .clone()
        .unwrap_or(same(1))
        .axes("stride", rank, 1)?;
    let padding = spec
        .padding
        .clone()
        .unwrap_or(same(0))
        .axes("padding", rank, 0)?;
    let dilation = spec
        .dilation
        .clone()
        .unwrap_or(same(1))
        .axes("dilation", rank, 1)?;
    let transposed = spec.transposed.unwrap_or(false);
    let output_padding = match (&spec.output_padding, transposed) {
        (None, _) => [0; 3],
        (Some(dims), true) => dims.axes("output_padding", rank, 0)?,
        (Some(_), false) => {
            return Err((
                "output_padding",
                "only a transposed layer has an output padding: add `transposed = true`".into(),
            ))
        }
    };
    let groups = spec.groups.map_or(1, |Int(g)| g);
    let (Int(in_channels), Int(out_channels)) = (spec.in_channels, spec.out_channels);
    // Field by field first, so that the message points at the line the user must change.
    let input_field = if spec.depth.is_some() && input[0] < 1 {
        "depth"
    } else {
        "input"
    };
    let positive: [(&'static str, &[i64]); 7] = [
        ("in_channels", &[in_channels]),
        ("out_channels", &[out_channels]),
        (input_field, &input),
        ("kernel", &kernel),
        ("stride", &stride),
        ("dilation", &dilation),
        ("groups", &[groups]),
    ];
    for (field, values) in positive {
        if let Some(&value) = values.iter().find(|&&v| v < 1) {
            return Err((field, format!("must be positive, got {value}")));
        }
    }
    for (field, values) in [("padding", &padding), ("output_padding", &output_padding)] {
        if let Some(&value) = values.iter().find(|&&v| v < 0) {
            return Err((field, format!("must not be negative, got {value}")));
        }
    }
    // A transposed layer (PyTorch's ConvTransposeNd) maps to the convolution from its output
    // to its input: C = out_channels, K = in_channels, spatial = its output size.
    let (c, k, spatial) = if transposed {
        let mut out = [0; 3];
        for axis in 0..3 {
            // PyTorch's rule: the output padding is smaller than the stride or the dilation.
            if output_padding[axis] > 0 && output_padding[axis] >= stride[axis].max(dilation[axis])
            {
                return Err((
                    "output_padding",
                    format!(
                        "{} must be smaller than the stride ({}) or the dilation ({})",
                        output_padding[axis], stride[axis], dilation[axis]
                    ),
                ));
            }
            // PyTorch also allows one below the dilation but not below the stride. Such a
            // layer is no convolution's backward-data: the convolution of its output gives
            // more rows than its input (5x5 tuned as a problem whose output is 7x7), so it
            // would be tuned as another problem. Refused, as the PyTorch package leaves it to
            // PyTorch's convolution.
            if output_padding[axis] > 0 && output_padding[axis] >= stride[axis] {
                return Err((
                    "output_padding",
                    format!(
                        "{} is not smaller than the stride ({}): PyTorch allows it below the \
                         dilation, but the layer is then not the backward-data of a convolution, \
                         which is what mucudnn tunes",
                        output_padding[axis], stride[axis]
                    ),
                ));
            }
            out[axis] = transposed_output(
                input[axis],
                kernel[axis],
                stride[axis],
                padding[axis],
                dilation[axis],
                output_padding[axis],
            )?;
            if out[axis] < 1 {
                return Err((
                    "padding",
                    format!(
                        "the transposed output is {} on an axis: the padding is too large for the input and kernel",
                        out[axis]
                    ),
                ));
            }
        }
        (out_channels, in_channels, out)
    } else {
        (in_channels, out_channels, input)
    };
    let problem = ConvProblem {
        pad_d: padding[0],
        pad_h: padding[1],
        pad_w: padding[2],
        stride_d: stride[0],
        stride_h: stride[1],
        stride_w: stride[2],
        dilation_d: dilation[0],
        dilation_h: dilation[1],
        dilation_w: dilation[2],
        groups,
        dtype,
        layout,
        ..ConvProblem::new_3d(
            batch, c, spatial[0], spatial[1], spatial[2], k, kernel[0], kernel[1], kernel[2],
        )
    };
    problem.validate().map_err(|err| {
        let field = match &err {
            ShapeError::Groups { .. } => "groups",
            ShapeError::NotPositive { field, .. }
            | ShapeError::Negative { field, .. }
            | ShapeError::FieldTooLarge { field, .. } => file_field(field, transposed),
            // The filter (with its dilation) does not fit the padded input.
            ShapeError::EmptyOutput { .. } => "kernel",
            ShapeError::TooLarge { what: "filter", .. } => "kernel",
            ShapeError::TooLarge { .. } => "input",
        };
        let message = match &err {
            ShapeError::TooLarge { .. } => format!("{err} at batch size {batch}"),
            _ => err.to_string(),
        };
        (field, message)
    })?;
    Ok(problem)
}

/// A transposed layer's output size on one axis, PyTorch's `(in - 1) * stride - 2 * padding +
/// dilation * (kernel - 1) + output_padding + 1`, in checked arithmetic: a value that
/// overflows names the field that made it so, where a wrapped sum used to blame `input`. An
/// output past 2^31 - 1 is refused here for the same reason (the problem's check would name
/// the output's field, which is no field of the file).
fn transposed_output(
    input: i64,
    kernel: i64,
    stride: i64,
    padding: i64,
    dilation: i64,
    output_padding: i64,
) -> Result<i64, (&'static str, String)> {
    const MAX: i64 = i32::MAX as i64;
    let too_large = |field: &'static str, value: i64| {
        (
            field,
            format!("{value} is too large: the transposed output would pass 2^31 - 1 on an axis"),
        )
    };
    let span = (input - 1)
        .checked_mul(stride)
        .filter(|&v| v <= MAX)
        .ok_or_else(|| match stride > input {
            true => too_large("stride", stride),
            false => too_large("input", input),
        })?;
    let reach = (kernel - 1)
        .checked_mul(dilation)
        .filter(|&v| v <= MAX)
        .ok_or_else(|| match dilation > kernel {
            true => too_large("dilation", dilation),
            false => too_large("kernel", kernel),
        })?;
    let twice_padding = padding
        .checked_mul(2)
        .ok_or_else(|| too_large("padding", padding))?;
    let out = span
        .checked_add(reach)
        .and_then(|v| v.checked_add(output_padding))
        .and_then(|v| v.checked_add(1))
        .ok_or_else(|| too_large("output_padding", output_padding))?
        .checked_sub(twice_padding)
        .ok_or_else(|| too_large("padding", padding))?;
    if out > MAX {
        return Err(match output_padding > span.max(reach) {
            true => too_large("output_padding", output_padding),
            false if span >= reach => too_large("stride", stride),
            false => too_large("kernel", kernel),
        });
    }
    Ok(out)
}

/// The file's name for a [`ConvProblem`] field (a transposed layer's channels are swapped).
fn file_field(problem_field: &str, transposed: bool) -> &'static str {
    match problem_field {
        "c" if transposed => "out_channels",
        "k" if transposed => "in_channels",
        "c" => "in_channels",
        "k" => "out_channels",
        "d" | "h" | "w" => "input",
        "t" | "r" | "s" => "kernel",
        "stride_d" | "stride_h" | "stride_w" => "stride",
        "dilation_d" | "dilation_h" | "dilation_w" => "dilation",
        "pad_d" | "pad_h" | "pad_w" => "padding",
        "groups" => "groups",
        _ => "input",
    }
}

/// Names end up in tables, profiles and file names: no blanks, nothing invisible.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "`{}` contains whitespace or control characters",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// The key (in document order) that is not among `known`, if any.
fn first_unknown<'t, 'i>(
    table: &'t DeTable<'i>,
    known: &[&str],
) -> Option<(
    &'t Spanned<std::borrow::Cow<'i, str>>,
    &'t Spanned<DeValue<'i>>,
)> {
    table
        .iter()
        .filter(|(key, _)| !known.contains(&key.get_ref().as_ref()))
        .min_by_key(|(key, _)| key.span().start)
}

fn expected_list(fields: &[&str]) -> String {
    fields
        .iter()
        .map(|f| format!("`{f}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn type_name(value: &Spanned<DeValue<'_>>) -> &'static str {
    value.get_ref().type_str()
}

fn contains(span: &Range<usize>, at: usize) -> bool {
    span.start <= at && at < span.end.max(span.start + 1)
}

/// Byte offset -> 1-based line.
struct LineIndex {
    /// Offsets at which lines start.
    starts: Vec<usize>,
    len: usize,
}

impl LineIndex {
    fn new(text: &str) -> Self {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        LineIndex {
            starts,
            len: text.len(),
        }
    }

    fn line(&self, offset: usize) -> usize {
        self.starts
            .partition_point(|&start| start <= offset.min(self.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = include_str!("../examples/networks/tiny.toml");
    const VGG_BLOCK: &str = include_str!("../examples/networks/vgg-block.toml");
    const TINY_3D: &str = include_str!("../examples/networks/tiny-3d.toml");

    fn parse(text: &str) -> Result<Network, NetworkError> {
        parse_network(text, 4, DType::Fp32, Layout::Nchw)
    }

    /// Parses `text`, expects an error, and checks its line and that its message contains
    /// every one of `parts`.
    fn check_error(text: &str, line: usize, parts: &[&str]) -> NetworkError {
        let err = parse(text).expect_err("the file should be refused");
        let message = err.to_string();
        assert_eq!(err.line(), Some(line), "{message}");
        assert!(message.starts_with(&format!("line {line}: ")), "{message}");
        for part in parts {
            assert!(message.contains(part), "`{part}` not in: {message}");
        }
        err
    }

    /// A one-layer file with `extra` lines appended to the layer (line 7 onwards).
    fn one_layer(extra: &str) -> String {
        format!(
            "[[layer]]\nname = \"c\"\nin_channels = 4\nout_channels = 4\ninput = 8\nkernel = 3\n{extra}"
        )
    }

    #[test]
    fn tiny_example() {
        let net = parse_network(TINY, 2, DType::Fp16, Layout::Nhwc).unwrap();
        assert_eq!(net.name.as_deref(), Some("tiny"));
        let names: Vec<&str> = net.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["tiny.conv1", "tiny.conv2", "tiny.conv3_dw"]);
        assert_eq!(net.convolutions(), 4);
        let conv1 = &net.layers[0].problem;
        assert_eq!(
            *conv1,
            ConvProblem {
                pad_h: 1,
                pad_w: 1,
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                ..ConvProblem::new(2, 3, 12, 12, 8, 3, 3)
            }
        );
        let conv2 = &net.layers[1].problem;
        assert_eq!(
            (conv2.h, conv2.w, conv2.stride_h, conv2.stride_w),
            (12, 12, 2, 2)
        );
        assert_eq!(conv2.output_hw(), (6, 6));
        let dw = &net.layers[2];
        assert_eq!((dw.problem.groups, dw.count), (8, 2));
        // Small enough for CPU tuning in debug builds.
        for layer in &net.layers {
            let p = &layer.problem;
            assert!(
                p.c <= 8 && p.k <= 8 && p.h <= 12 && p.w <= 12,
                "{}",
                layer.name
            );
        }
    }

    #[test]
    fn vgg_block_example_merges_repeated_shapes() {
        let net = parse_network(VGG_BLOCK, 64, DType::Fp32, Layout::Nchw).unwrap();
        let summary: Vec<(&str, u32)> = net
            .layers
            .iter()
            .map(|l| (l.name.as_str(), l.count))
            .collect();
        assert_eq!(
            summary,
            [
                ("vgg16_block3.conv3_1", 1),
                ("vgg16_block3.conv3_2", 2),
                ("vgg16_block3.conv4_1", 1)
            ]
        );
        // The same shapes as the zoo's VGG-16.
        let zoo = crate::models::Model::Vgg16.layers(64, DType::Fp32, Layout::Nchw);
        for layer in &net.layers {
            let suffix = layer.name.trim_start_matches("vgg16_block3.");
            let twin = zoo
                .iter()
                .find(|z| z.name == format!("vgg16.{suffix}"))
                .unwrap();
            assert_eq!(twin.problem, layer.problem, "{}", layer.name);
        }
    }

    #[test]
    fn pairs_defaults_and_no_prefix() {
        let text =
            one_layer("stride = [1, 2]\npadding = [0, 1]\ndilation = 2\ngroups = 2\ncount = 3\n")
                .replace("input = 8", "input = [9, 10]")
                .replace("kernel = 3", "kernel = [3, 1]");
        let net = parse(&text).unwrap();
        assert_eq!(net.name, None);
        let layer = &net.layers[0];
        assert_eq!((layer.name.as_str(), layer.count), ("c", 3));
        let p = &layer.problem;
        assert_eq!((p.n, p.c, p.h, p.w, p.k, p.r, p.s), (4, 4, 9, 10, 4, 3, 1));
        assert_eq!((p.stride_h, p.stride_w, p.pad_h, p.pad_w), (1, 2, 0, 1));
        assert_eq!((p.dilation_h, p.dilation_w, p.groups), (2, 2, 2));
        let defaults = parse(&one_layer("")).unwrap().layers[0].problem;
        assert_eq!(defaults, ConvProblem::new(4, 4, 8, 8, 4, 3, 3));
    }

    #[test]
    fn unknown_fields() {
        let err = check_error(&one_layer("").replace("kernel", "kernal"), 6, &[]);
        assert_eq!(
            err.to_string(),
            "line 6: unknown field `kernal` in layer 1 (expected one of `name`, `in_channels`, \
             `out_channels`, `input`, `depth`, `kernel`, `stride`, `padding`, `dilation`, \
             `groups`, `transposed`, `output_padding`, `count`)"
        );
        // The first unknown key in the file is reported, not the first alphabetically.
        let two = one_layer("zzz = 1\naaa = 2\n");
        check_error(&two, 7, &["unknown field `zzz` in layer 1"]);
        let top = format!("nmae = \"x\"\n{}", one_layer(""));
        check_error(
            &top,
            1,
            &["unknown field `nmae` at the top level", "`name`, `layer`"],
        );
        // A sub-table of a layer is an unknown field of that layer.
        let nested = format!(
            "{}[[layer]]\nname = \"d\"\n[layer.extra]\nx = 1\n",
            one_layer("")
        );
        check_error(&nested, 9, &["unknown field `extra` in layer 2"]);
    }

    #[test]
    fn wrong_types() {
        let text = one_layer("").replace("in_channels = 4", "in_channels = \"four\"");
        check_error(
            &text,
            3,
            &[
                "layer 1 `c`",
                "field `in_channels`",
                "string",
                "expected an integer",
            ],
        );
        let text = one_layer("stride = 1.5\n");
        check_error(
            &text,
            7,
            &[
                "field `stride`",
                "1.5",
                "an integer or an array of one to three integers",
            ],
        );
        let text = one_layer("padding = [1, 2, 3, 4]\n");
        check_error(
            &text,
            7,
            &[
                "field `padding`",
                "an integer or an array of one to three integers",
            ],
        );
        let text = one_layer("padding = []\n");
        check_error(&text, 7, &["field `padding`", "invalid length 0"]);
        let text = one_layer("transposed = 1\n");
        check_error(&text, 7, &["field `transposed`", "expected a boolean"]);
        let text = one_layer("").replace("kernel = 3", "kernel = [3]");
        check_error(&text, 6, &["field `kernel`"]);
        let text = one_layer("").replace("name = \"c\"", "name = 7");
        check_error(&text, 2, &["layer 1:", "field `name`"]);
        let text = one_layer("count = 99999999999999999999\n");
        check_error(&text, 7, &["field `count`"]);
        let top = format!("name = [1]\n{}", one_layer(""));
        check_error(
            &top,
            1,
            &["the top level: field `name`", "expected a string"],
        );
        let single = "[layer]\nname = \"c\"\n";
        check_error(single, 1, &["field `layer`", "write `[[layer]]`"]);
        let not_table = "layer = [1, 2]\n";
        check_error(not_table, 1, &["layer 1: field `layer`: expected a table"]);
    }

    #[test]
    fn missing_fields_point_at_the_layer_header() {
        let text = format!(
            "{}\n[[layer]]\nname = \"d\"\nin_channels = 4\n",
            one_layer("")
        );
        check_error(&text, 8, &["layer 2 `d`: missing field `out_channels`"]);
        let inline =
            "layer = [\n  {name = \"a\", in_channels = 1, out_channels = 1, input = 4},\n]\n";
        check_error(inline, 2, &["layer 1 `a`: missing field `kernel`"]);
    }

    #[test]
    fn invalid_shapes_name_the_field() {
        let zero = one_layer("").replace("in_channels = 4", "in_channels = 0");
        check_error(&zero, 3, &["field `in_channels`: must be positive, got 0"]);
        check_error(
            &one_layer("padding = [0, -1]\n"),
            7,
            &["`padding`: must not be negative"],
        );
        check_error(
            &one_layer("stride = [1, 0]\n"),
            7,
            &["`stride`: must be positive"],
        );
        check_error(
            &one_layer("groups = 3\n"),
            7,
            &["field `groups`", "divisible by groups (3)"],
        );
        let big = one_layer("").replace("kernel = 3", "kernel = 9");
        check_error(&big, 6, &["field `kernel`", "output height size is 0"]);
        check_error(
            &one_layer("dilation = 5\n"),
            6,
            &["field `kernel`", "dilated filter 11"],
        );
        check_error(
            &one_layer("count = 0\n"),
            7,
            &["field `count`: must be at least 1, got 0"],
        );
        // Too many is not too few: the error says "too large", not "at least 1".
        check_error(
            &one_layer("count = 4294967296\n"),
            7,
            &["field `count`: 4294967296 is too large (at most 4294967295)"],
        );
        // Past 2^31 elements a layer is tuned with plans that split it; past 2^60 it is no
        // layer.
        let huge = one_layer("")
            .replace("in_channels = 4", "in_channels = 2")
            .replace("input = 8", "input = 2147483647");
        check_error(&huge, 5, &["field `input`", "too large", "batch size 4"]);
        let big = one_layer("")
            .replace("in_channels = 4", "in_channels = 65536")
            .replace("input = 8", "input = 4096");
        assert!(parse(&big).is_ok());
        let blank = one_layer("").replace("name = \"c\"", "name = \"my conv\"");
        check_error(&blank, 2, &["field `name`", "whitespace"]);
        let empty = one_layer("").replace("name = \"c\"", "name = \"\"");
        check_error(&empty, 2, &["field `name`: must not be empty"]);
    }

    #[test]
    fn tiny_3d_example() {
        let net = parse_network(TINY_3D, 2, DType::Fp32, Layout::Nchw).unwrap();
        let shapes: Vec<(&str, [i64; 5], [i64; 5])> = net
            .layers
            .iter()
            .map(|l| {
                (
                    l.name.as_str(),
                    l.problem.input_dims(),
                    l.problem.filter_dims(),
                )
            })
            .collect();
        assert_eq!(
            shapes,
            [
                ("tiny3d.conv1", [2, 3, 4, 8, 8], [4, 3, 3, 3, 3]),
                ("tiny3d.causal", [2, 4, 6, 4, 4], [4, 4, 3, 3, 3]),
                // Transposed: tuned as the conv from its 4x8x8 output back to its input.
                ("tiny3d.up", [2, 2, 4, 8, 8], [4, 2, 1, 2, 2]),
                ("tiny3d.audio", [2, 1, 1, 1, 40], [4, 1, 1, 1, 10]),
            ]
        );
        assert_eq!(net.layers[1].problem.output_dhw(), (4, 4, 4));
        assert_eq!(net.layers[2].problem.output_dhw(), (4, 4, 4));
        // Small enough for the CPU in debug builds: at most ~100k MACs per sample.
        for layer in &net.layers {
            let p = &layer.problem;
            let (o, q, r) = p.output_dhw();
            let macs = o * q * r * p.k * (p.c / p.groups) * p.t * p.r * p.s;
            assert!(macs <= 100_000, "{}: {macs}", layer.name);
        }
    }

    /// 3-D layers: `input = [D, H, W]` or `depth`; per-axis values, single numbers repeated.
    #[test]
    fn three_d_layers() {
        let text = "[[layer]]\nname = \"stem\"\nin_channels = 3\nout_channels = 64\n\
                    input = [16, 112, 112]\nkernel = [3, 7, 7]\nstride = [1, 2, 2]\n\
                    padding = [1, 3, 3]\n\
                    [[layer]]\nname = \"b\"\nin_channels = 64\nout_channels = 64\n\
                    depth = 16\ninput = 56\nkernel = 3\npadding = 1\ndilation = [2, 1, 1]\n";
        let net = parse_network(text, 2, DType::Fp16, Layout::Nhwc).unwrap();
        let stem = &net.layers[0].problem;
        // The same problem as the zoo's r3d_18 stem.
        let zoo = crate::models::Model::R3d18.layers(2, DType::Fp16, Layout::Nhwc);
        assert_eq!(*stem, zoo[0].problem);
        assert_eq!(stem.layout_name(), "ndhwc");
        let b = &net.layers[1].problem;
        assert_eq!((b.d, b.h, b.w, b.t, b.r, b.s), (16, 56, 56, 3, 3, 3));
        assert_eq!((b.pad_d, b.pad_h, b.dilation_d, b.dilation_h), (1, 1, 2, 1));
        assert_eq!(b.output_dhw(), (14, 56, 56));
        // Arrays must match the rank (one number repeats); `depth` goes with a 2-D input only.
        let cube = one_layer("").replace("input = 8", "input = [4, 8, 8]");
        assert_eq!(parse(&cube).unwrap().layers[0].problem.t, 3);
        let two_kernel = one_layer("")
            .replace("input = 8", "input = [4, 8, 8]")
            .replace("kernel = 3", "kernel = [3, 3]");
        check_error(
            &two_kernel,
            6,
            &["field `kernel`: 2 values for a 3-D layer, which takes 3 ([d, h, w])"],
        );
        let stride = one_layer("stride = [1, 2]\n").replace("input = 8", "input = [4, 8, 8]");
        check_error(&stride, 7, &["field `stride`: 2 values for a 3-D layer"]);
        let depth = one_layer("depth = 4\n").replace("input = 8", "input = [4, 8, 8]");
        check_error(&depth, 7, &["field `depth`", "already has the depth"]);
        check_error(
            &one_layer("depth = 0\n"),
            7,
            &["field `depth`: must be positive, got 0"],
        );
        let deep = one_layer("depth = 2\n").replace("kernel = 3", "kernel = [3, 3, 3]");
        check_error(&deep, 6, &["field `kernel`", "output depth size is 0"]);
    }

    /// 1-D layers are 2-D with unit height; transposed layers map to the convolution whose
    /// backward-data they are.
    #[test]
    fn one_d_and_transposed_layers() {
        let text = one_layer("stride = 5\n")
            .replace("in_channels = 4", "in_channels = 1")
            .replace("out_channels = 4", "out_channels = 512")
            .replace("input = 8", "input = [16000]")
            .replace("kernel = 3", "kernel = 10");
        let net = parse(&text).unwrap();
        let zoo = crate::models::Model::Wav2Vec2Fe.layers(4, DType::Fp32, Layout::Nchw);
        assert_eq!(net.layers[0].problem, zoo[0].problem);
        // ConvTranspose2d(8, 4, kernel 3, stride 2, padding 1, output_padding 1) on 5x6:
        // out = (in - 1) * 2 - 2 + 2 + 1 + 1 = 2 * in.
        let text = one_layer("stride = 2\npadding = 1\noutput_padding = 1\ntransposed = true\n")
            .replace("in_channels = 4", "in_channels = 8")
            .replace("input = 8", "input = [5, 6]");
        let p = parse(&text).unwrap().layers[0].problem;
        assert_eq!((p.c, p.k, p.h, p.w, p.r, p.s), (4, 8, 10, 12, 3, 3));
        // The convolution maps the transposed layer's output back to its input.
        assert_eq!(p.output_hw(), (5, 6));
        // ConvTranspose3d with per-axis output padding and a temporal stride of 1.
        let text = one_layer(
            "stride = [1, 2, 2]\npadding = [1, 0, 0]\noutput_padding = [0, 1, 0]\ntransposed = true\n",
        )
        .replace("input = 8", "input = [4, 5, 5]");
        let p = parse(&text).unwrap().layers[0].problem;
        assert_eq!((p.d, p.h, p.w), (4, 12, 11));
        assert_eq!(p.output_dhw(), (4, 5, 5));
        check_error(
            &one_layer("output_padding = 1\n"),
            7,
            &["field `output_padding`", "add `transposed = true`"],
        );
        check_error(
            &one_layer("transposed = true\noutput_padding = 1\n"),
            8,
            &["field `output_padding`: 1 must be smaller than the stride (1) or the dilation (1)"],
        );
        check_error(
            &one_layer("transposed = true\npadding = 5\n"),
            8,
            &["field `padding`", "transposed output is 0"],
        );
        // Below the dilation but not below the stride: PyTorch runs it, but it is no
        // convolution's backward-data (its output, 5x5 here... would be tuned as 7x7).
        check_error(
            &one_layer("transposed = true\nstride = 1\ndilation = 3\noutput_padding = 2\n"),
            10,
            &["field `output_padding`: 2 is not smaller than the stride (1)"],
        );
        // Huge values: checked arithmetic names the field, with its value.
        for (line, field, value) in [
            (
                "stride = 4611686018427387904\n",
                "stride",
                "4611686018427387904",
            ),
            (
                "padding = 4611686018427387904\n",
                "padding",
                "4611686018427387904",
            ),
            (
                "kernel = 4611686018427387904\n",
                "kernel",
                "4611686018427387904",
            ),
            (
                "dilation = 4611686018427387904\n",
                "dilation",
                "4611686018427387904",
            ),
            ("stride = 3000000000\n", "stride", "3000000000"),
        ] {
            let text = one_layer(&format!("transposed = true\n{line}")).replace(
                "kernel = 3\n",
                if field == "kernel" {
                    ""
                } else {
                    "kernel = 3\n"
                },
            );
            let err = parse(&text).expect_err(line).to_string();
            assert!(err.contains(&format!("field `{field}`")), "{line}: {err}");
            assert!(err.contains(value), "{line}: {err}");
            let wrapped = err
                .as_bytes()
                .windows(2)
                .any(|w| w[0] == b'-' && w[1].is_ascii_digit());
            assert!(!wrapped, "a wrapped value: {err}");
        }
        let grouped = one_layer("transposed = true\ngroups = 3\n")
            .replace("in_channels = 4", "in_channels = 6");
        check_error(&grouped, 8, &["field `groups`", "divisible by groups (3)"]);
    }

    #[test]
    fn duplicate_names() {
        let text = format!(
            "name = \"n\"\n{}\n{}",
            one_layer(""),
            one_layer("groups = 2\n")
        );
        check_error(
            &text,
            10,
            &["layer 2 `c`", "`n.c` is already used by layer 1 (line 3)"],
        );
    }

    #[test]
    fn syntax_errors_empty_files_and_batch() {
        check_error(
            "[[layer]]\nname = \"a\"\nin_channels = \n",
            3,
            &["TOML syntax error"],
        );
        check_error("[[layer]\n", 1, &["TOML syntax error"]);
        for empty in ["", "# nothing\n", "name = \"x\"\n", "layer = []\n"] {
            assert!(
                matches!(parse(empty), Err(NetworkError::NoLayers)),
                "{empty:?}"
            );
        }
        let err = parse_network(TINY, 0, DType::Fp32, Layout::Nchw).unwrap_err();
        assert!(matches!(err, NetworkError::BadBatch { batch: 0 }), "{err}");
    }

    #[test]
    fn files() {
        let dir = std::env::temp_dir().join(format!("mucudnn-network-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, TINY).unwrap();
        let net = read_network(&good, 1, DType::Fp32, Layout::Nchw).unwrap();
        assert_eq!(net.layers.len(), 3);
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, one_layer("kernal = 1\n")).unwrap();
        let err = read_network(&bad, 1, DType::Fp32, Layout::Nchw).unwrap_err();
        assert_eq!(err.line(), Some(7));
        let message = err.to_string();
        assert!(
            message.contains("bad.toml: line 7: unknown field `kernal`"),
            "{message}"
        );
        let missing = read_network(&dir.join("nope.toml"), 1, DType::Fp32, Layout::Nchw);
        assert!(matches!(missing, Err(NetworkError::Read { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
