//! The TCP rendezvous of a multi-process (multi-node) run: how the processes of one training
//! job find each other and agree on NCCL's unique id before NCCL itself can connect them.
//!
//! Pure Rust (`std::net`), no CUDA: everything here is tested on any machine.
//!
//! # Roles
//!
//! Every process knows its `rank`, the `world_size` and the master's address and port (from
//! `--rank`, `--world-size`, `--master-addr`, `--master-port`, or the environment variables
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK` that `torchrun` and most
//! launchers set: [`RendezvousArgs::resolve_env`]). Rank 0 is the master: it listens on the
//! port ([`RendezvousListener::bind`]) and waits until every other rank has connected and said
//! hello ([`RendezvousListener::accept`]); the others connect, retrying until the master is up
//! or the timeout passes ([`Rendezvous::connect`]). [`Rendezvous::establish`] does whichever
//! the rank calls for; with a world size of 1 it opens no socket at all.
//!
//! After that the ranks run the same collectives in the same order, all through the master:
//! [`Rendezvous::broadcast_bytes`] (rank 0's bytes to everyone: NCCL's 128-byte unique id),
//! [`Rendezvous::barrier`], [`Rendezvous::all_gather_bytes`] and [`Rendezvous::gpu_layout`].
//!
//! # Wire format
//!
//! Every message is one frame: a 12-byte header, then the payload.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "MUCR"
//! 4       2     protocol version, little-endian (1)
//! 6       1     message kind (hello, welcome, reject, abort, blob, arrive, release, gather,
//!               gathered)
//! 7       1     reserved, 0
//! 8       4     payload length in bytes, little-endian (at most 64 MiB)
//! ```
//!
//! A frame with another magic (some other service on the port), another version (a different
//! mucudnn build) or an oversized length is an error that names the peer and what arrived. The
//! master refuses a second process with the same rank, a rank it does not expect, or a
//! different world size, tells the offender why (a reject frame), tells the ranks already
//! connected that it gave up (an abort frame) and returns the error, so that every process
//! stops with a message that says what is wrong instead of waiting for a timeout.
//!
//! # Where rank 0 listens
//!
//! On `master_addr` itself when that is a loopback address or `localhost` (a single-host job:
//! nothing is exposed); otherwise on every interface (`0.0.0.0`), because a host name may
//! resolve to a loopback address on the master's own host (Debian's `127.0.1.1`) while the
//! other hosts reach it by another. The port is open only until every rank has joined.

#![forbid(unsafe_code)]

use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MUCR";
/// The protocol version this build speaks; a peer with another version is refused.
pub const PROTOCOL_VERSION: u16 = 1;
/// The largest payload a frame may carry.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;
/// The master's port when neither `--master-port` nor `MASTER_PORT` gives one (PyTorch's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// How long joining and each collective may take by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The environment variables read by [`RendezvousArgs::resolve_env`].
pub const ENV_RANK: &str = "RANK";
pub const ENV_WORLD_SIZE: &str = "WORLD_SIZE";
pub const ENV_MASTER_ADDR: &str = "MASTER_ADDR";
pub const ENV_MASTER_PORT: &str = "MASTER_PORT";
pub const ENV_LOCAL_RANK: &str = "LOCAL_RANK";

const HEADER_BYTES: usize = 12;
/// Pause between accept polls on the master.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// First and longest pause between connection attempts.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// Longest single connect attempt (a silently dropped SYN would otherwise take minutes).
const CONNECT_ATTEMPT_MAX: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Errors

/// Why the rendezvous failed. Messages name the peer (rank and address), what was being waited
/// for, and what to check.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The configuration is inconsistent or a flag/variable does not parse.
    #[error("invalid rendezvous configuration: {0}")]
    Config(String),

    /// The master's address does not resolve.
    #[error("cannot resolve the master address {addr}: {message}")]
    Resolve { addr: String, message: String },

    /// Rank 0 cannot listen on the master port.
    #[error(
        "rank 0 cannot listen on {addr}: {message} (is another job using port {port}? pick \
         another --master-port / MASTER_PORT)"
    )]
    Bind {
        addr: String,
        port: u16,
        message: String,
    },

    /// A rank could not reach the master before the timeout.
    #[error(
        "rank {rank} could not connect to the master at {addr} within {:.1} s ({attempts} \
         attempts, last error: {last_error}): is rank 0 running, and do all ranks use the same \
         --master-addr/--master-port (MASTER_ADDR/MASTER_PORT)?",
        .after.as_secs_f64()
    )]
    Connect {
        rank: usize,
        addr: String,
        attempts: u32,
        after: Duration,
        last_error: String,
    },

    /// Joining or a collective did not complete in time.
    #[error("timed out after {:.1} s waiting for {waiting_for}", .after.as_secs_f64())]
    Timeout {
        waiting_for: String,
        after: Duration,
    },

    /// A peer sent something this protocol does not allow there: another magic or version, an
    /// oversized or malformed frame, or a message out of order.
    #[error("protocol error with {peer}: {detail}")]
    Protocol { peer: String, detail: String },

    /// The master refused this rank (duplicate rank, different world size, ...).
    #[error("rank {rank} was refused by the master: {reason}")]
    Rejected { rank: usize, reason: String },

    /// The master gave up (another rank misbehaved or did not come) and said why.
    #[error("the master aborted the rendezvous: {reason}")]
    Aborted { reason: String },

    /// Two processes claim the same rank.
    #[error(
        "rank {rank} joined twice, as {first} and as {second} (every process needs its own \
         --rank / RANK)"
    )]
    DuplicateRank {
        rank: usize,
        first: String,
        second: String,
    },

    /// A peer was started with another world size.
    #[error(
        "{peer} has world size {theirs}, the master {ours} (every process needs the same \
         --world-size / WORLD_SIZE)"
    )]
    WorldSizeMismatch {
        peer: String,
        theirs: usize,
        ours: usize,
    },

    /// A peer closed its connection (it exited or crashed).
    #[error("{peer} closed the connection while this process was {during}")]
    PeerClosed { peer: String, during: String },

    /// Any other socket error.
    #[error("socket error with {peer} while {during}: {message}")]
    Io {
        peer: String,
        during: String,
        message: String,
    },
}

fn config_error(detail: impl Into<String>) -> RendezvousError {
    RendezvousError::Config(detail.into())
}

/// Classifies a socket error during `during` with `peer`; `timeout` is how long the read or
/// write was allowed to take.
fn io_error(e: io::Error, peer: &str, during: &str, timeout: Duration) -> RendezvousError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => RendezvousError::Timeout {
            waiting_for: format!("{peer} ({during})"),
            after: timeout,
        },
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => RendezvousError::PeerClosed {
            peer: peer.to_string(),
            during: during.to_string(),
        },
        _ => RendezvousError::Io {
            peer: peer.to_string(),
            during: during.to_string(),
            message: e.to_string(),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration

/// Who this process is in the job and where the master is. Build it with [`Self::new`] or
/// [`RendezvousArgs::resolve_env`]; both validate it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// This process's rank, `0..world_size`; rank 0 is the master.
    pub rank: usize,
    /// How many processes take part.
    pub world_size: usize,
    /// This process's index on its host (`LOCAL_RANK`): the GPU it drives when a process
    /// drives one. Defaults to `rank`.
    pub local_rank: usize,
    /// Rank 0's host name or IP address.
    pub master_addr: String,
    /// Rank 0's port (0 on the master: any free port, see [`RendezvousListener::local_addr`]).
    pub master_port: u16,
    /// How long joining and each collective may take.
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// A validated configuration with `local_rank = rank` and [`DEFAULT_TIMEOUT`].
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Result<Self, RendezvousError> {
        let config = RendezvousConfig {
            rank,
            world_size,
            local_rank: rank,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
        };
        config.validate()?;
        Ok(config)
    }

    /// Rank 0 of 1: a single process, no network.
    pub fn single_process() -> Self {
        RendezvousConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn with_local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = local_rank;
        self
    }

    pub fn with_master_port(mut self, master_port: u16) -> Self {
        self.master_port = master_port;
        self
    }

    /// World size at least 1, rank below it, a positive timeout, and a master address when
    /// there is more than one process.
    pub fn validate(&self) -> Result<(), RendezvousError> {
        if self.world_size == 0 {
            return Err(config_error(
                "the world size is 0: it counts the processes and must be at least 1",
            ));
        }
        if self.rank >= self.world_size {
            return Err(config_error(format!(
                "rank {} is not below the world size {} (ranks are 0..{})",
                self.rank, self.world_size, self.world_size
            )));
        }
        if u32::try_from(self.world_size).is_err() {
            return Err(config_error(format!(
                "world size {} is too large",
                self.world_size
            )));
        }
        if self.timeout.is_zero() {
            return Err(config_error("the rendezvous timeout is 0"));
        }
        if self.world_size > 1 && self.master_addr.trim().is_empty() {
            return Err(config_error("the master address is empty"));
        }
        Ok(())
    }
}

/// Rendezvous settings as given on the command line; what is missing comes from the
/// environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`), then from
/// defaults. Flags win over the environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RendezvousArgs {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub local_rank: Option<usize>,
    pub timeout: Option<Duration>,
}

impl RendezvousArgs {
    /// [`Self::resolve`] with the process environment.
    pub fn resolve_env(&self) -> Result<RendezvousConfig, RendezvousError> {
        self.resolve(|name| std::env::var(name).ok())
    }

    /// Combines the flags with `env` (a variable lookup; empty values count as unset):
    /// neither rank nor world size anywhere is a single process; a world size above 1 needs a
    /// rank and a master address; the port defaults to [`DEFAULT_MASTER_PORT`] and the local
    /// rank to the rank.
    pub fn resolve(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<RendezvousConfig, RendezvousError> {
        let lookup = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let number = |flag: Option<usize>, name: &str| -> Result<Option<usize>, RendezvousError> {
            match (flag, lookup(name)) {
                (Some(v), _) => Ok(Some(v)),
                (None, Some(text)) => text.trim().parse::<usize>().map(Some).map_err(|_| {
                    config_error(format!("{name}={text:?} is not a non-negative integer"))
                }),
                (None, None) => Ok(None),
            }
        };
        let rank = number(self.rank, ENV_RANK)?;
        let world_size = number(self.world_size, ENV_WORLD_SIZE)?;
        let local_rank = number(self.local_rank, ENV_LOCAL_RANK)?;
        let master_port = match (self.master_port, lookup(ENV_MASTER_PORT)) {
            (Some(port), _) => port,
            (None, Some(text)) => text.trim().parse::<u16>().map_err(|_| {
                config_error(format!(
                    "{ENV_MASTER_PORT}={text:?} is not a port number (0..=65535)"
                ))
            })?,
            (None, None) => DEFAULT_MASTER_PORT,
        };
        let (rank, world_size) = match (rank, world_size) {
            (None, None) => (0, 1),
            (Some(rank), None) => {
                return Err(config_error(format!(
                    "rank {rank} is given (--rank or {ENV_RANK}) but no world size: pass \
                     --world-size or set {ENV_WORLD_SIZE}"
                )))
            }
            (None, Some(1)) => (0, 1),
            (None, Some(world_size)) => {
                return Err(config_error(format!(
                    "world size {world_size} is given but not this process's rank: pass --rank \
                     or set {ENV_RANK}"
                )))
            }
            (Some(rank), Some(world_size)) => (rank, world_size),
        };
        let mut config = RendezvousConfig {
            rank,
            world_size,
            local_rank: local_rank.unwrap_or(rank),
            master_addr: "127.0.0.1".to_string(),
            master_port,
            timeout: self.timeout.unwrap_or(DEFAULT_TIMEOUT),
        };
        // Rank, world size and timeout problems first: they explain a missing address too.
        config.validate()?;
        config.master_addr = match self.master_addr.clone().or_else(|| lookup(ENV_MASTER_ADDR)) {
            Some(addr) => addr.trim().to_string(),
            None if world_size == 1 => config.master_addr,
            None => {
                return Err(config_error(format!(
                    "world size {world_size} needs the master's address: pass --master-addr or \
                     set {ENV_MASTER_ADDR} (rank 0's host name or IP address)"
                )))
            }
        };
        config.validate()?;
        Ok(config)
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

/// The message kinds (the header's byte 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    /// Member -> master: rank and world size (two u32, little-endian).
    Hello = 1,
    /// Master -> member: admitted.
    Welcome = 2,
    /// Master -> member: refused; the payload is the reason (UTF-8).
    Reject = 3,
    /// Master -> members: the master gave up; the payload is the reason (UTF-8).
    Abort = 4,
    /// Master -> members: [`Rendezvous::broadcast_bytes`]'s bytes.
    Blob = 5,
    /// Member -> master: reached the barrier.
    Arrive = 6,
    /// Master -> members: everyone reached the barrier.
    Release = 7,
    /// Member -> master: this rank's [`Rendezvous::all_gather_bytes`] bytes.
    Gather = 8,
    /// Master -> members: every rank's bytes, in rank order, each as a u32 length + bytes.
    Gathered = 9,
}

impl Kind {
    const ALL: [Kind; 9] = [
        Kind::Hello,
        Kind::Welcome,
        Kind::Reject,
        Kind::Abort,
        Kind::Blob,
        Kind::Arrive,
        Kind::Release,
        Kind::Gather,
        Kind::Gathered,
    ];

    fn from_u8(byte: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == byte)
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Hello => "a hello",
            Kind::Welcome => "a welcome",
            Kind::Reject => "a refusal",
            Kind::Abort => "an abort",
            Kind::Blob => "a broadcast",
            Kind::Arrive => "a barrier arrival",
            Kind::Release => "a barrier release",
            Kind::Gather => "an all-gather contribution",
            Kind::Gathered => "an all-gather result",
        }
    }
}

fn encode_frame(kind: Kind, payload: &[u8]) -> Result<Vec<u8>, RendezvousError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(config_error(format!(
            "{} of {} bytes exceeds the rendezvous limit of {MAX_PAYLOAD_BYTES} bytes",
            kind.name(),
            payload.len()
        )));
    }
    let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    frame.push(kind as u8);
    frame.push(0);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

/// Checks a header and returns its kind and payload length.
fn decode_header(
    header: &[u8; HEADER_BYTES],
    peer: &str,
) -> Result<(Kind, usize), RendezvousError> {
    let protocol = |detail: String| RendezvousError::Protocol {
        peer: peer.to_string(),
        detail,
    };
    if header[..4] != MAGIC {
        return Err(protocol(format!(
            "the first bytes are {:?} ({}), not the mucudnn rendezvous magic \"MUCR\": is \
             another service listening on the master port?",
            String::from_utf8_lossy(&header[..4]),
            hex(&header[..4])
        )));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(protocol(format!(
            "it speaks rendezvous protocol version {version}, this build {PROTOCOL_VERSION}: run \
             the same mucudnn build on every rank"
        )));
    }
    let kind = Kind::from_u8(header[6])
        .ok_or_else(|| protocol(format!("unknown message kind {}", header[6])))?;
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]) as usize;
    if len > MAX_PAYLOAD_BYTES {
        return Err(protocol(format!(
            "{} of {len} bytes exceeds the limit of {MAX_PAYLOAD_BYTES} bytes",
            kind.name()
        )));
    }
    Ok((kind, len))
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reads one frame; `timeout` is only for the message of a timeout error (the socket's read
/// timeout does the timing).
fn read_frame(
    reader: &mut impl Read,
    peer: &str,
    during: &str,
    timeout: Duration,
) -> Result<(Kind, Vec<u8>), RendezvousError> {
    let mut header = [0u8; HEADER_BYTES];
    reader
        .read_exact(&mut header)
        .map_err(|e| io_error(e, peer, during, timeout))?;
    let (kind, len) = decode_header(&header, peer)?;
    let mut payload = vec![0u8; len];
    reader
        .read_exact(&mut payload)
        .map_err(|e| io_error(e, peer, during, timeout))?;
    Ok((kind, payload))
}

fn write_frame(
    writer: &mut impl Write,
    peer: &str,
    during: &str,
    timeout: Duration,
    kind: Kind,
    payload: &[u8],
) -> Result<(), RendezvousError> {
    let frame = encode_frame(kind, payload)?;
    writer
        .write_all(&frame)
        .and_then(|()| writer.flush())
        .map_err(|e| io_error(e, peer, during, timeout))
}

/// The error for a frame of kind `got` where `want` was expected.
fn unexpected(peer: &str, got: Kind, payload: &[u8], want: Kind, rank: usize) -> RendezvousError {
    let text = || String::from_utf8_lossy(payload).into_owned();
    match got {
        Kind::Abort => RendezvousError::Aborted { reason: text() },
        Kind::Reject => RendezvousError::Rejected {
            rank,
            reason: text(),
        },
        _ => RendezvousError::Protocol {
            peer: peer.to_string(),
            detail: format!(
                "it sent {} where this process expected {}: do all ranks run the same \
                 rendezvous steps in the same order?",
                got.name(),
                want.name()
            ),
        },
    }
}

fn hello_payload(rank: usize, world_size: usize) -> Vec<u8> {
    let mut payload = Vec::with_capacity(8);
    payload.extend_from_slice(&(rank as u32).to_le_bytes());
    payload.extend_from_slice(&(world_size as u32).to_le_bytes());
    payload
}

fn parse_hello(payload: &[u8], peer: &str) -> Result<(usize, usize), RendezvousError> {
    let bytes: [u8; 8] = payload.try_into().map_err(|_| RendezvousError::Protocol {
        peer: peer.to_string(),
        detail: format!("a hello of {} bytes (expected 8)", payload.len()),
    })?;
    let rank = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let world_size = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    Ok((rank, world_size))
}

fn encode_gathered(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 4).sum());
    for part in parts {
        out.extend_from_slice(&(part.len() as u32).to_le_bytes());
        out.extend_from_slice(part);
    }
    out
}

fn decode_gathered(
    payload: &[u8],
    world_size: usize,
    peer: &str,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let malformed = |detail: String| RendezvousError::Protocol {
        peer: peer.to_string(),
        detail: format!("a malformed all-gather result: {detail}"),
    };
    let mut parts = Vec::with_capacity(world_size);
    let mut rest = payload;
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err(malformed(format!("{} trailing bytes", rest.len())));
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if rest.len() - 4 < len {
            return Err(malformed(format!(
                "part {} claims {len} bytes, {} remain",
                parts.len(),
                rest.len() - 4
            )));
        }
        parts.push(rest[4..4 + len].to_vec());
        rest = &rest[4 + len..];
    }
    if parts.len() != world_size {
        return Err(malformed(format!(
            "{} parts for a world of {world_size}",
            parts.len()
        )));
    }
    Ok(parts)
}

// ---------------------------------------------------------------------------------------------
// Joining

/// One TCP connection to another rank.
#[derive(Debug)]
struct Peer {
    /// E.g. `rank 3 (10.0.0.7:51234)` or `the master at node0:29500`.
    label: String,
    stream: TcpStream,
}

impl Peer {
    fn send(
        &mut self,
        during: &str,
        timeout: Duration,
        kind: Kind,
        payload: &[u8],
    ) -> Result<(), RendezvousError> {
        write_frame(
            &mut self.stream,
            &self.label,
            during,
            timeout,
            kind,
            payload,
        )
    }

    fn receive(
        &mut self,
        during: &str,
        timeout: Duration,
        want: Kind,
        my_rank: usize,
    ) -> Result<Vec<u8>, RendezvousError> {
        let (kind, payload) = read_frame(&mut self.stream, &self.label, during, timeout)?;
        if kind == want {
            Ok(payload)
        } else {
            Err(unexpected(&self.label, kind, &payload, want, my_rank))
        }
    }
}

fn configure_stream(
    stream: &TcpStream,
    read_timeout: Duration,
    write_timeout: Duration,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(read_timeout.max(Duration::from_millis(1))))?;
    stream.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1))))
}

fn resolve(addr: &str, port: u16) -> Result<Vec<SocketAddr>, RendezvousError> {
    let resolved: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Resolve {
            addr: addr.to_string(),
            message: e.to_string(),
        })?
        .collect();
    if resolved.is_empty() {
        return Err(RendezvousError::Resolve {
            addr: addr.to_string(),
            message: "no address".to_string(),
        });
    }
    Ok(resolved)
}

/// The addresses rank 0 tries to listen on, in order (see the module docs).
fn listen_addresses(master_addr: &str, port: u16) -> Result<Vec<SocketAddr>, RendezvousError> {
    let host = master_addr.trim();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = host.parse::<IpAddr>() {
        let listen = if ip.is_loopback() || ip.is_unspecified() {
            ip
        } else if ip.is_ipv4() {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        };
        return Ok(vec![SocketAddr::new(listen, port)]);
    }
    let resolved = resolve(host, port)?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(resolved);
    }
    let mut listen = Vec::new();
    if resolved.iter().any(SocketAddr::is_ipv4) {
        listen.push(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    }
    if resolved.iter().any(SocketAddr::is_ipv6) {
        listen.push(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port));
    }
    Ok(listen)
}

/// Rank 0's listening socket, bound and waiting for the other ranks. Binding first and
/// accepting later lets a caller learn the port (bind port 0, read [`Self::local_addr`]) before
/// the others start.
#[derive(Debug)]
pub struct RendezvousListener {
    config: RendezvousConfig,
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl RendezvousListener {
    /// Listens on the master port (see the module docs for the address). `config.rank` must
    /// be 0.
    pub fn bind(config: &RendezvousConfig) -> Result<Self, RendezvousError> {
        config.validate()?;
        if config.rank != 0 {
            return Err(config_error(format!(
                "rank {} cannot listen: only rank 0 is the master",
                config.rank
            )));
        }
        let mut last: Option<(SocketAddr, io::Error)> = None;
        for addr in listen_addresses(&config.master_addr, config.master_port)? {
            match TcpListener::bind(addr) {
                Ok(listener) => {
                    let local_addr = listener.local_addr().map_err(|e| RendezvousError::Bind {
                        addr: addr.to_string(),
                        port: config.master_port,
                        message: e.to_string(),
                    })?;
                    return Ok(RendezvousListener {
                        config: config.clone(),
                        listener,
                        local_addr,
                    });
                }
                Err(e) => last = Some((addr, e)),
            }
        }
        let (addr, e) = last.expect("listen_addresses returns at least one address");
        Err(RendezvousError::Bind {
            addr: addr.to_string(),
            port: config.master_port,
            message: e.to_string(),
        })
    }

    /// The address actually bound (with the real port when the configuration said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until ranks `1..world_size` have all connected and said hello (each admitted at
    /// once with a welcome), then closes the port. Refuses a duplicate rank, a rank out of
    /// range, another world size or a stranger (wrong magic or version), telling the offender
    /// and the ranks already admitted why, and times out after the configured timeout.
    pub fn accept(self) -> Result<Rendezvous, RendezvousError> {
        let config = &self.config;
        let deadline = Instant::now() + config.timeout;
        let mut peers: Vec<Option<Peer>> = (1..config.world_size).map(|_| None).collect();
        let listen_label = format!("the master port {}", self.local_addr);
        self.listener
            .set_nonblocking(true)
            .map_err(|e| io_error(e, &listen_label, "preparing to accept", config.timeout))?;
        while peers.iter().any(Option::is_none) {
            match self.listener.accept() {
                Ok((stream, addr)) => {
                    if let Err(e) = admit(config, stream, addr, deadline, &mut peers) {
                        abort_all(&mut peers, config.timeout, &e.to_string());
                        return Err(e);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| i + 1)
                            .collect();
                        let e = RendezvousError::Timeout {
                            waiting_for: format!(
                                "rank(s) {missing:?} of world size {} to connect to {} (are they \
                                 running, with this --master-addr/--master-port?)",
                                config.world_size, self.local_addr
                            ),
                            after: config.timeout,
                        };
                        abort_all(&mut peers, config.timeout, &e.to_string());
                        return Err(e);
                    }
                    std::thread::sleep(ACCEPT_POLL);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let e = io_error(e, &listen_label, "accepting connections", config.timeout);
                    abort_all(&mut peers, config.timeout, &e.to_string());
                    return Err(e);
                }
            }
        }
        let peers = peers.into_iter().map(|p| p.expect("all joined")).collect();
        Ok(Rendezvous {
            rank: 0,
            world_size: config.world_size,
            timeout: config.timeout,
            link: Link::Master(peers),
        })
    }
}

/// Reads one newcomer's hello and admits it into `peers`, or refuses it (telling it why).
fn admit(
    config: &RendezvousConfig,
    mut stream: TcpStream,
    addr: SocketAddr,
    deadline: Instant,
    peers: &mut [Option<Peer>],
) -> Result<(), RendezvousError> {
    let label = format!("the process at {addr}");
    let remaining = deadline.saturating_duration_since(Instant::now());
    configure_stream(&stream, remaining, config.timeout)
        .map_err(|e| io_error(e, &label, "accepting it", config.timeout))?;
    let (kind, payload) = read_frame(&mut stream, &label, "waiting for its hello", remaining)?;
    if kind != Kind::Hello {
        return Err(RendezvousError::Protocol {
            peer: label,
            detail: format!("its first message is {}, not a hello", kind.name()),
        });
    }
    let (rank, world_size) = parse_hello(&payload, &label)?;
    let refusal = if world_size != config.world_size {
        Some(RendezvousError::WorldSizeMismatch {
            peer: format!("rank {rank} ({addr})"),
            theirs: world_size,
            ours: config.world_size,
        })
    } else if rank == 0 {
        Some(RendezvousError::DuplicateRank {
            rank,
            first: "the master (this process)".to_string(),
            second: format!("the process at {addr}"),
        })
    } else if rank >= config.world_size {
        Some(RendezvousError::Protocol {
            peer: label.clone(),
            detail: format!(
                "it claims rank {rank}, outside world size {}",
                config.world_size
            ),
        })
    } else {
        peers[rank - 1]
            .as_ref()
            .map(|first| RendezvousError::DuplicateRank {
                rank,
                first: first.label.clone(),
                second: format!("rank {rank} ({addr})"),
            })
    };
    if let Some(e) = refusal {
        // Best effort: the newcomer learns why; the master's error is what matters.
        let _ = write_frame(
            &mut stream,
            &label,
            "refusing it",
            config.timeout,
            Kind::Reject,
            e.to_string().as_bytes(),
        );
        return Err(e);
    }
    let mut peer = Peer {
        label: format!("rank {rank} ({addr})"),
        stream,
    };
    peer.send("admitting it", config.timeout, Kind::Welcome, &[])?;
    peer.stream
        .set_read_timeout(Some(config.timeout))
        .map_err(|e| io_error(e, &peer.label, "admitting it", config.timeout))?;
    peers[rank - 1] = Some(peer);
    Ok(())
}

/// Tells every admitted rank that the master gave up (best effort).
fn abort_all(peers: &mut [Option<Peer>], timeout: Duration, reason: &str) {
    for peer in peers.iter_mut().flatten() {
        let _ = peer.send("aborting", timeout, Kind::Abort, reason.as_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// The joined group

#[derive(Debug)]
enum Link {
    /// World size 1: nobody to talk to.
    Alone,
    /// Rank 0: a connection to each other rank, index `i` for rank `i + 1`.
    Master(Vec<Peer>),
    /// Ranks 1..: the connection to the master.
    Member(Peer),
}

/// The joined group of processes, seen from one of them. Every rank must run the same
/// collectives in the same order; a mismatch is a protocol error on both sides.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    link: Link,
}

/// Where one process's GPUs sit among every process's GPUs (see [`Rendezvous::gpu_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuLayout {
    /// The NCCL rank of this process's first GPU (its GPU `i` is rank `first_rank + i`).
    pub first_rank: usize,
    /// How many GPUs this process drives.
    pub local_gpus: usize,
    /// The NCCL world size: every process's GPUs.
    pub world_gpus: usize,
}

impl Rendezvous {
    /// Joins the group: rank 0 listens and accepts everyone, the others connect; a world size
    /// of 1 opens no socket.
    pub fn establish(config: &RendezvousConfig) -> Result<Self, RendezvousError> {
        config.validate()?;
        if config.world_size == 1 {
            Ok(Rendezvous {
                rank: 0,
                world_size: 1,
                timeout: config.timeout,
                link: Link::Alone,
            })
        } else if config.rank == 0 {
            RendezvousListener::bind(config)?.accept()
        } else {
            Self::connect(config)
        }
    }

    /// Connects a rank other than 0 to the master, retrying (50 ms, doubling up to 1 s) while
    /// the master is not up yet, until the timeout; then says hello and waits to be admitted.
    pub fn connect(config: &RendezvousConfig) -> Result<Self, RendezvousError> {
        config.validate()?;
        if config.rank == 0 {
            return Err(config_error(
                "rank 0 is the master: it listens (Rendezvous::establish or \
                 RendezvousListener::bind) rather than connects",
            ));
        }
        let started = Instant::now();
        let deadline = started + config.timeout;
        let target = if config.master_addr.contains(':') && !config.master_addr.starts_with('[') {
            format!("[{}]:{}", config.master_addr, config.master_port)
        } else {
            format!("{}:{}", config.master_addr, config.master_port)
        };
        let label = format!("the master at {target}");
        let mut attempts = 0u32;
        let mut delay = RETRY_FIRST;
        loop {
            attempts += 1;
            let last_error = match resolve(config.master_addr.trim(), config.master_port) {
                Ok(addrs) => {
                    let mut last_error = String::new();
                    for addr in addrs {
                        let remaining = deadline.saturating_duration_since(Instant::now());
                        let attempt = remaining
                            .min(CONNECT_ATTEMPT_MAX)
                            .max(Duration::from_millis(1));
                        match TcpStream::connect_timeout(&addr, attempt) {
                            Ok(stream) => {
                                return Self::join(config, stream, label, deadline);
                            }
                            Err(e) => last_error = format!("{addr}: {e}"),
                        }
                    }
                    last_error
                }
                Err(e) => e.to_string(),
            };
            let now = Instant::now();
            if now + delay >= deadline {
                return Err(RendezvousError::Connect {
                    rank: config.rank,
                    addr: target,
                    attempts,
                    after: now - started,
                    last_error,
                });
            }
            std::thread::sleep(delay);
            delay = (delay * 2).min(RETRY_MAX);
        }
    }

    /// Says hello over a fresh connection and waits for the master's answer.
    fn join(
        config: &RendezvousConfig,
        stream: TcpStream,
        label: String,
        deadline: Instant,
    ) -> Result<Self, RendezvousError> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        configure_stream(&stream, remaining, config.timeout)
            .map_err(|e| io_error(e, &label, "connecting", config.timeout))?;
        let mut master = Peer { label, stream };
        master.send(
            "saying hello",
            config.timeout,
            Kind::Hello,
            &hello_payload(config.rank, config.world_size),
        )?;
        master.receive(
            "waiting to be admitted",
            remaining,
            Kind::Welcome,
            config.rank,
        )?;
        master
            .stream
            .set_read_timeout(Some(config.timeout))
            .map_err(|e| io_error(e, &master.label, "connecting", config.timeout))?;
        Ok(Rendezvous {
            rank: config.rank,
            world_size: config.world_size,
            timeout: config.timeout,
            link: Link::Member(master),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank 0's bytes on every rank (NCCL's unique id: rank 0 creates it, everyone needs it).
    /// Rank 0 passes `Some(bytes)`, the others `None`; every rank gets the bytes back.
    pub fn broadcast_bytes(
        &mut self,
        root_bytes: Option<&[u8]>,
    ) -> Result<Vec<u8>, RendezvousError> {
        const DURING: &str = "broadcasting rank 0's bytes";
        let timeout = self.timeout;
        match (&mut self.link, root_bytes) {
            (Link::Alone, Some(bytes)) => Ok(bytes.to_vec()),
            (Link::Master(peers), Some(bytes)) => {
                for peer in peers.iter_mut() {
                    peer.send(DURING, timeout, Kind::Blob, bytes)?;
                }
                Ok(bytes.to_vec())
            }
            (Link::Member(master), None) => master.receive(DURING, timeout, Kind::Blob, self.rank),
            (Link::Alone | Link::Master(_), None) => Err(config_error(
                "broadcast_bytes: rank 0 must pass the bytes to broadcast (Some)",
            )),
            (Link::Member(_), Some(_)) => Err(config_error(format!(
                "broadcast_bytes: only rank 0 passes bytes; rank {} passes None and receives them",
                self.rank
            ))),
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), RendezvousError> {
        const DURING: &str = "in a barrier";
        let timeout = self.timeout;
        match &mut self.link {
            Link::Alone => Ok(()),
            Link::Master(peers) => {
                for peer in peers.iter_mut() {
                    peer.receive(DURING, timeout, Kind::Arrive, 0)?;
                }
                for peer in peers.iter_mut() {
                    peer.send(DURING, timeout, Kind::Release, &[])?;
                }
                Ok(())
            }
            Link::Member(master) => {
                master.send(DURING, timeout, Kind::Arrive, &[])?;
                master.receive(DURING, timeout, Kind::Release, self.rank)?;
                Ok(())
            }
        }
    }

    /// Every rank's bytes, in rank order, on every rank.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        const DURING: &str = "in an all-gather";
        let timeout = self.timeout;
        match &mut self.link {
            Link::Alone => Ok(vec![mine.to_vec()]),
            Link::Master(peers) => {
                let mut parts = Vec::with_capacity(peers.len() + 1);
                parts.push(mine.to_vec());
                for peer in peers.iter_mut() {
                    parts.push(peer.receive(DURING, timeout, Kind::Gather, 0)?);
                }
                let all = encode_gathered(&parts);
                for peer in peers.iter_mut() {
                    peer.send(DURING, timeout, Kind::Gathered, &all)?;
                }
                Ok(parts)
            }
            Link::Member(master) => {
                master.send(DURING, timeout, Kind::Gather, mine)?;
                let all = master.receive(DURING, timeout, Kind::Gathered, self.rank)?;
                decode_gathered(&all, self.world_size, &master.label)
            }
        }
    }

    /// NCCL ranks when each process drives `local_gpus` GPUs (one thread and one NCCL rank
    /// each): an all-gather of the counts, so process `p`'s first GPU is rank
    /// `sum(counts[..p])`. With one GPU per process this is `(rank, 1, world_size)`.
    pub fn gpu_layout(&mut self, local_gpus: usize) -> Result<GpuLayout, RendezvousError> {
        if local_gpus == 0 {
            return Err(config_error(format!(
                "rank {} drives no GPU: every process needs at least one",
                self.rank
            )));
        }
        let parts = self.all_gather_bytes(&(local_gpus as u64).to_le_bytes())?;
        let mut counts = Vec::with_capacity(parts.len());
        for (rank, part) in parts.iter().enumerate() {
            let bytes: [u8; 8] =
                part.as_slice()
                    .try_into()
                    .map_err(|_| RendezvousError::Protocol {
                        peer: format!("rank {rank}"),
                        detail: format!("a GPU count of {} bytes (expected 8)", part.len()),
                    })?;
            counts.push(u64::from_le_bytes(bytes) as usize);
        }
        let first_rank = counts[..self.rank].iter().sum();
        let world_gpus = counts.iter().sum();
        Ok(GpuLayout {
            first_rank,
            local_gpus,
            world_gpus,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::thread;

    const LOCALHOST: &str = "127.0.0.1";
    const LONG: Duration = Duration::from_secs(20);

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn config(rank: usize, world_size: usize, port: u16, timeout: Duration) -> RendezvousConfig {
        RendezvousConfig::new(rank, world_size, LOCALHOST, port)
            .unwrap()
            .with_timeout(timeout)
    }

    /// A port that was free a moment ago (bound to port 0, then released).
    fn free_port() -> u16 {
        TcpListener::bind((LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Binds rank 0 on an ephemeral port and returns its listener and port.
    fn master(world_size: usize, timeout: Duration) -> (RendezvousListener, u16) {
        let listener = RendezvousListener::bind(&config(0, world_size, 0, timeout)).unwrap();
        let port = listener.local_addr().port();
        assert_ne!(port, 0);
        (listener, port)
    }

    /// Runs `body` on every rank of a world on localhost (rank 0 on this thread) and returns
    /// the results in rank order.
    fn run_world<T: Send + 'static>(
        world_size: usize,
        body: impl Fn(&mut Rendezvous) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let (listener, port) = master(world_size, LONG);
        let members: Vec<_> = (1..world_size)
            .map(|rank| {
                let body = body.clone();
                thread::spawn(move || {
                    let mut rv =
                        Rendezvous::connect(&config(rank, world_size, port, LONG)).unwrap();
                    assert_eq!((rv.rank(), rv.world_size()), (rank, world_size));
                    body(&mut rv)
                })
            })
            .collect();
        let mut rv = listener.accept().unwrap();
        let mut results = vec![body(&mut rv)];
        // Close the master's connections before waiting for the others (as a process would).
        drop(rv);
        results.extend(members.into_iter().map(|m| m.join().unwrap()));
        results
    }

    // ---- configuration

    #[test]
    fn config_validation() {
        assert!(RendezvousConfig::new(0, 1, LOCALHOST, 1).is_ok());
        let e = RendezvousConfig::new(2, 2, LOCALHOST, 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid rendezvous configuration: rank 2 is not below the world size 2 (ranks are 0..2)"
        );
        let e = RendezvousConfig::new(0, 0, LOCALHOST, 1).unwrap_err();
        assert!(e.to_string().contains("world size is 0"), "{e}");
        let e = RendezvousConfig::new(1, 2, " ", 1).unwrap_err();
        assert!(e.to_string().contains("master address is empty"), "{e}");
        let zero = RendezvousConfig::single_process().with_timeout(Duration::ZERO);
        assert!(zero.validate().is_err());
        assert!(Rendezvous::establish(&zero).is_err());
        let single = RendezvousConfig::single_process();
        assert_eq!(
            (single.rank, single.world_size, single.local_rank),
            (0, 1, 0)
        );
    }

    #[test]
    fn args_resolve_flags_then_environment_then_defaults() {
        // Nothing anywhere: one process.
        let c = RendezvousArgs::default().resolve(env_of(&[])).unwrap();
        assert_eq!(c, RendezvousConfig::single_process());
        // torchrun's variables.
        let env = env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "12345"),
            ("LOCAL_RANK", "1"),
        ]);
        let c = RendezvousArgs::default().resolve(&env).unwrap();
        assert_eq!(
            (
                c.rank,
                c.world_size,
                c.local_rank,
                c.master_addr.as_str(),
                c.master_port
            ),
            (3, 8, 1, "node0", 12345)
        );
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        // Flags win.
        let args = RendezvousArgs {
            rank: Some(5),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(999),
            timeout: Some(Duration::from_secs(7)),
            ..RendezvousArgs::default()
        };
        let c = args.resolve(&env).unwrap();
        assert_eq!(
            (
                c.rank,
                c.world_size,
                c.local_rank,
                c.master_addr.as_str(),
                c.master_port
            ),
            (5, 8, 1, "10.0.0.1", 999)
        );
        assert_eq!(c.timeout, Duration::from_secs(7));
        // Local rank defaults to the rank; the port to 29500; empty values are unset.
        let c = RendezvousArgs::default()
            .resolve(env_of(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("LOCAL_RANK", ""),
            ]))
            .unwrap();
        assert_eq!((c.local_rank, c.master_port), (1, DEFAULT_MASTER_PORT));
        // WORLD_SIZE=1 alone is a single process.
        let c = RendezvousArgs::default()
            .resolve(env_of(&[("WORLD_SIZE", "1")]))
            .unwrap();
        assert_eq!((c.rank, c.world_size), (0, 1));
    }

    #[test]
    fn args_errors_name_the_flag_or_variable() {
        let check = |pairs: &[(&str, &str)], args: RendezvousArgs, expected: &str| {
            let e = args.resolve(env_of(pairs)).unwrap_err();
            assert!(matches!(e, RendezvousError::Config(_)), "{e:?}");
            assert!(e.to_string().contains(expected), "{e} lacks {expected:?}");
        };
        let none = RendezvousArgs::default;
        check(
            &[("RANK", "x1")],
            none(),
            "RANK=\"x1\" is not a non-negative integer",
        );
        check(&[("WORLD_SIZE", "-2")], none(), "WORLD_SIZE=\"-2\"");
        check(&[("LOCAL_RANK", "one")], none(), "LOCAL_RANK=\"one\"");
        check(
            &[("MASTER_PORT", "70000")],
            none(),
            "MASTER_PORT=\"70000\" is not a port number",
        );
        check(
            &[("RANK", "1")],
            none(),
            "pass --world-size or set WORLD_SIZE",
        );
        check(&[("WORLD_SIZE", "4")], none(), "pass --rank or set RANK");
        check(
            &[("RANK", "1"), ("WORLD_SIZE", "4")],
            none(),
            "pass --master-addr or set MASTER_ADDR",
        );
        check(
            &[("WORLD_SIZE", "4"), ("MASTER_ADDR", "h")],
            RendezvousArgs {
                rank: Some(4),
                ..none()
            },
            "rank 4 is not below the world size 4",
        );
        check(
            &[("RANK", "0"), ("WORLD_SIZE", "0")],
            none(),
            "world size is 0",
        );
    }

    // ---- frames

    #[test]
    fn frames_round_trip_and_reject_strangers() {
        let frame = encode_frame(Kind::Blob, b"unique id").unwrap();
        assert_eq!(&frame[..4], b"MUCR");
        assert_eq!(frame.len(), HEADER_BYTES + 9);
        let (kind, payload) = read_frame(&mut frame.as_slice(), "peer", "testing", LONG).unwrap();
        assert_eq!((kind, payload.as_slice()), (Kind::Blob, &b"unique id"[..]));

        let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let e =
            read_frame(&mut &http[..], "the process at 1.2.3.4:5", "testing", LONG).unwrap_err();
        assert!(matches!(e, RendezvousError::Protocol { .. }), "{e:?}");
        let message = e.to_string();
        assert!(message.contains("the process at 1.2.3.4:5"), "{message}");
        assert!(message.contains("\"GET \""), "{message}");
        assert!(message.contains("47 45 54 20"), "{message}");
        assert!(message.contains("another service"), "{message}");

        let mut future = frame.clone();
        future[4..6].copy_from_slice(&7u16.to_le_bytes());
        let e = read_frame(&mut future.as_slice(), "peer", "testing", LONG).unwrap_err();
        assert!(
            e.to_string().contains("protocol version 7, this build 1"),
            "{e}"
        );

        let mut unknown = frame.clone();
        unknown[6] = 200;
        let e = read_frame(&mut unknown.as_slice(), "peer", "testing", LONG).unwrap_err();
        assert!(e.to_string().contains("unknown message kind 200"), "{e}");

        let mut huge = frame.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = read_frame(&mut huge.as_slice(), "peer", "testing", LONG).unwrap_err();
        assert!(e.to_string().contains("exceeds the limit"), "{e}");

        let truncated = &frame[..frame.len() - 1];
        let e = read_frame(&mut &truncated[..], "rank 2", "testing", LONG).unwrap_err();
        assert_eq!(
            e,
            RendezvousError::PeerClosed {
                peer: "rank 2".into(),
                during: "testing".into()
            }
        );
        assert!(encode_frame(Kind::Blob, &vec![0; MAX_PAYLOAD_BYTES + 1]).is_err());
    }

    #[test]
    fn gathered_payload_round_trips_and_is_checked() {
        let parts = vec![b"a".to_vec(), Vec::new(), b"ccc".to_vec()];
        let encoded = encode_gathered(&parts);
        assert_eq!(decode_gathered(&encoded, 3, "m").unwrap(), parts);
        assert!(decode_gathered(&encoded, 2, "m").is_err());
        assert!(decode_gathered(&encoded[..encoded.len() - 1], 3, "m").is_err());
        assert!(decode_gathered(&[1, 0], 1, "m").is_err());
        assert_eq!(parse_hello(&hello_payload(3, 8), "p").unwrap(), (3, 8));
        assert!(parse_hello(&[0; 7], "p").is_err());
    }

    #[test]
    fn listen_addresses_stay_local_for_local_masters() {
        let local = listen_addresses("127.0.0.1", 5).unwrap();
        assert_eq!(local, vec!["127.0.0.1:5".parse().unwrap()]);
        let remote = listen_addresses("10.1.2.3", 5).unwrap();
        assert_eq!(remote, vec!["0.0.0.0:5".parse().unwrap()]);
        let v6 = listen_addresses("[::1]", 5).unwrap();
        assert_eq!(v6, vec!["[::1]:5".parse().unwrap()]);
        assert!(listen_addresses("localhost", 5)
            .unwrap()
            .iter()
            .all(|a| a.ip().is_loopback()));
    }

    // ---- one process

    #[test]
    fn world_of_one_needs_no_network() {
        let mut rv = Rendezvous::establish(&RendezvousConfig::single_process()).unwrap();
        assert_eq!((rv.rank(), rv.world_size()), (0, 1));
        assert_eq!(rv.broadcast_bytes(Some(b"id")).unwrap(), b"id");
        assert!(rv.broadcast_bytes(None).is_err());
        rv.barrier().unwrap();
        assert_eq!(rv.all_gather_bytes(b"x").unwrap(), vec![b"x".to_vec()]);
        assert_eq!(
            rv.gpu_layout(2).unwrap(),
            GpuLayout {
                first_rank: 0,
                local_gpus: 2,
                world_gpus: 2
            }
        );
        assert!(rv.gpu_layout(0).is_err());
    }

    // ---- several processes (threads on localhost)

    #[test]
    fn four_ranks_share_a_unique_id_and_run_collectives() {
        let id: Vec<u8> = (0..128).map(|i| (i * 7 + 3) as u8).collect();
        let results = run_world(4, move |rv| {
            let rank = rv.rank();
            let got = if rank == 0 {
                rv.broadcast_bytes(Some(&id)).unwrap()
            } else {
                rv.broadcast_bytes(None).unwrap()
            };
            rv.barrier().unwrap();
            let gathered = rv.all_gather_bytes(&[rank as u8; 3][..rank]).unwrap();
            let layout = rv.gpu_layout(rank + 1).unwrap();
            rv.barrier().unwrap();
            (got, gathered, layout)
        });
        let expected_id: Vec<u8> = (0..128).map(|i| (i * 7 + 3) as u8).collect();
        for (rank, (got, gathered, layout)) in results.into_iter().enumerate() {
            assert_eq!(got, expected_id, "rank {rank}");
            assert_eq!(
                gathered,
                vec![vec![], vec![1], vec![2, 2], vec![3, 3, 3]],
                "rank {rank}"
            );
            // GPU counts 1, 2, 3, 4: first ranks 0, 1, 3, 6 of 10.
            assert_eq!(
                layout,
                GpuLayout {
                    first_rank: [0, 1, 3, 6][rank],
                    local_gpus: rank + 1,
                    world_gpus: 10
                }
            );
        }
    }

    #[test]
    fn ranks_started_before_the_master_retry_until_it_is_up() {
        let port = free_port();
        let members: Vec<_> = (1..3)
            .map(|rank| {
                thread::spawn(move || {
                    let mut rv = Rendezvous::connect(&config(rank, 3, port, LONG)).unwrap();
                    rv.broadcast_bytes(None).unwrap()
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(300));
        let mut rv = Rendezvous::establish(&config(0, 3, port, LONG)).unwrap();
        rv.broadcast_bytes(Some(b"late")).unwrap();
        for m in members {
            assert_eq!(m.join().unwrap(), b"late");
        }
    }

    #[test]
    fn no_master_is_a_connect_error_after_the_timeout() {
        let port = free_port();
        let started = Instant::now();
        let e = Rendezvous::connect(&config(1, 2, port, Duration::from_millis(400))).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        match &e {
            RendezvousError::Connect {
                rank,
                attempts,
                addr,
                ..
            } => {
                assert_eq!(*rank, 1);
                assert!(*attempts >= 2, "{attempts}");
                assert_eq!(addr, &format!("127.0.0.1:{port}"));
            }
            other => panic!("{other:?}"),
        }
        let message = e.to_string();
        assert!(message.contains("is rank 0 running"), "{message}");
        assert!(message.contains("MASTER_ADDR/MASTER_PORT"), "{message}");
        // Rank 0 does not connect; others do not listen.
        assert!(Rendezvous::connect(&config(0, 2, port, LONG)).is_err());
        assert!(RendezvousListener::bind(&config(1, 2, port, LONG)).is_err());
    }

    #[test]
    fn missing_ranks_time_out_on_the_master_and_abort_the_others() {
        let (listener, port) = master(3, Duration::from_millis(600));
        let member = thread::spawn(move || {
            let mut rv = Rendezvous::connect(&config(1, 3, port, LONG)).unwrap();
            rv.barrier().unwrap_err()
        });
        let e = listener.accept().unwrap_err();
        match &e {
            RendezvousError::Timeout { waiting_for, .. } => {
                assert!(
                    waiting_for.contains("rank(s) [2] of world size 3"),
                    "{waiting_for}"
                )
            }
            other => panic!("{other:?}"),
        }
        let member_error = member.join().unwrap();
        match member_error {
            RendezvousError::Aborted { reason } => assert!(reason.contains("[2]"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn duplicate_rank_is_refused_with_a_clear_error_on_every_side() {
        let (listener, port) = master(3, LONG);
        let first = thread::spawn(move || {
            let mut rv = Rendezvous::connect(&config(1, 3, port, LONG)).unwrap();
            rv.barrier().unwrap_err()
        });
        // Let the first rank 1 be admitted before the impostor connects.
        let master = thread::spawn(move || listener.accept().unwrap_err());
        thread::sleep(Duration::from_millis(300));
        let second = Rendezvous::connect(&config(1, 3, port, LONG)).unwrap_err();
        let master_error = master.join().unwrap();
        assert!(
            matches!(master_error, RendezvousError::DuplicateRank { rank: 1, .. }),
            "{master_error:?}"
        );
        assert!(master_error.to_string().contains("its own --rank / RANK"));
        match second {
            RendezvousError::Rejected { rank: 1, reason } => {
                assert!(reason.contains("rank 1 joined twice"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            first.join().unwrap(),
            RendezvousError::Aborted { .. }
        ));
    }

    #[test]
    fn other_world_size_is_refused() {
        let (listener, port) = master(2, LONG);
        let member =
            thread::spawn(move || Rendezvous::connect(&config(1, 3, port, LONG)).unwrap_err());
        let e = listener.accept().unwrap_err();
        assert!(
            matches!(
                e,
                RendezvousError::WorldSizeMismatch {
                    theirs: 3,
                    ours: 2,
                    ..
                }
            ),
            "{e:?}"
        );
        match member.join().unwrap() {
            RendezvousError::Rejected { reason, .. } => {
                assert!(reason.contains("world size 3, the master 2"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn strangers_on_the_port_are_protocol_errors() {
        // A client that is not a mucudnn rank.
        let (listener, port) = master(2, LONG);
        let client = thread::spawn(move || {
            let mut s = TcpStream::connect((LOCALHOST, port)).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let e = listener.accept().unwrap_err();
        assert!(
            e.to_string().contains("not the mucudnn rendezvous magic"),
            "{e}"
        );
        client.join().unwrap();

        // A client of a future protocol version.
        let (listener, port) = master(2, LONG);
        let client = thread::spawn(move || {
            let mut s = TcpStream::connect((LOCALHOST, port)).unwrap();
            let mut frame = encode_frame(Kind::Hello, &hello_payload(1, 2)).unwrap();
            frame[4..6].copy_from_slice(&2u16.to_le_bytes());
            s.write_all(&frame).unwrap();
        });
        let e = listener.accept().unwrap_err();
        assert!(
            e.to_string().contains("protocol version 2, this build 1"),
            "{e}"
        );
        client.join().unwrap();

        // A server that is not a mucudnn master.
        let server = TcpListener::bind((LOCALHOST, 0)).unwrap();
        let port = server.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
            thread::sleep(Duration::from_millis(200));
        });
        let e = Rendezvous::connect(&config(1, 2, port, LONG)).unwrap_err();
        match &e {
            RendezvousError::Protocol { peer, detail } => {
                assert_eq!(peer, &format!("the master at 127.0.0.1:{port}"));
                assert!(detail.contains("\"SSH-\""), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        fake.join().unwrap();
    }

    #[test]
    fn collectives_out_of_order_are_protocol_errors() {
        let results = run_world(2, |rv| {
            if rv.rank() == 0 {
                rv.barrier().unwrap_err()
            } else {
                rv.all_gather_bytes(b"x").unwrap_err()
            }
        });
        match &results[0] {
            RendezvousError::Protocol { peer, detail } => {
                assert!(peer.starts_with("rank 1 ("), "{peer}");
                assert!(
                    detail.contains(
                        "sent an all-gather contribution where this process expected a barrier \
                         arrival"
                    ),
                    "{detail}"
                );
            }
            other => panic!("{other:?}"),
        }
        // The member then sees the master go away.
        assert!(
            matches!(
                results[1],
                RendezvousError::PeerClosed { .. } | RendezvousError::Io { .. }
            ),
            "{:?}",
            results[1]
        );
    }

    #[test]
    fn a_rank_that_exits_is_reported_by_rank() {
        let (listener, port) = master(2, LONG);
        let member = thread::spawn(move || {
            drop(Rendezvous::connect(&config(1, 2, port, LONG)).unwrap());
        });
        let mut rv = listener.accept().unwrap();
        member.join().unwrap();
        match rv.barrier().unwrap_err() {
            RendezvousError::PeerClosed { peer, during } => {
                assert!(peer.starts_with("rank 1 ("), "{peer}");
                assert_eq!(during, "in a barrier");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_silent_rank_times_out_in_a_collective() {
        let (listener, port) = master(2, Duration::from_millis(500));
        let member = thread::spawn(move || {
            let rv = Rendezvous::connect(&config(1, 2, port, LONG)).unwrap();
            thread::sleep(Duration::from_millis(1500));
            drop(rv);
        });
        let mut rv = listener.accept().unwrap();
        match rv.barrier().unwrap_err() {
            RendezvousError::Timeout { waiting_for, .. } => {
                assert!(waiting_for.contains("rank 1"), "{waiting_for}")
            }
            other => panic!("{other:?}"),
        }
        member.join().unwrap();
    }

    #[test]
    fn broadcast_misuse_is_a_config_error() {
        let results = run_world(2, |rv| {
            let misuse = if rv.rank() == 0 {
                rv.broadcast_bytes(None).unwrap_err()
            } else {
                rv.broadcast_bytes(Some(b"x")).unwrap_err()
            };
            rv.barrier().unwrap();
            misuse
        });
        assert!(results[0]
            .to_string()
            .contains("rank 0 must pass the bytes"));
        assert!(results[1].to_string().contains("only rank 0 passes bytes"));
    }
}
