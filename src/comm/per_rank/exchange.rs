//! The per-rank [`Comm`]'s point-to-point calls: `send`, `recv`, `all_to_all` and
//! `all_to_all_v`, each one exchange (`core::launch::exchange`), and the exchanges of a
//! group. Each pair of ranks synchronises alone, so ranks that a call does not involve
//! never wait for it.

use std::ops::Range;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::CollectiveOptions;

use super::{meta, Comm};
use crate::comm::core::launch::exchange::{PeerOps, Transfer};
use crate::comm::core::planning::check::{check_overlaps, Span};

/// The sends and receives of one exchange as this rank adds them, their buffers
/// borrowed until it launches: at most one send to and one receive from each world rank.
pub(crate) struct Exchange<'b, B: Backend> {
    sends: Vec<Parts<&'b dyn DeviceBuffer<B>>>,
    recvs: Vec<Parts<&'b mut dyn DeviceBufferMut<B>>>,
    /// Which ranks this rank sends to and receives from so far.
    sending: [bool; MAX_GPUS],
    receiving: [bool; MAX_GPUS],
    /// The blocks the calls asked for with each world rank (the most of them).
    blocks: [Option<u32>; MAX_GPUS],
}

/// The ranks and blocks of one point-to-point call's options: its peers are members
/// `0..width` of the rank's group, world ranks `base..base + width`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peers {
    base: usize,
    width: usize,
    blocks: Option<u32>,
}

/// A buffer and the element ranges of it that go to (or come from) each peer.
struct Parts<T> {
    buf: T,
    parts: Vec<(usize, Range<usize>)>,
}

impl<B: Backend> Default for Exchange<'_, B> {
    fn default() -> Self {
        Exchange {
            sends: Vec::new(),
            recvs: Vec::new(),
            sending: [false; MAX_GPUS],
            receiving: [false; MAX_GPUS],
            blocks: [None; MAX_GPUS],
        }
    }
}

impl<'b, B: Backend> Exchange<'b, B> {
    /// Whether `other`'s peers are free here (then it can join this exchange).
    pub(crate) fn can_take(&self, other: &Exchange<'b, B>) -> bool {
        (0..MAX_GPUS).all(|q| {
            !(self.sending[q] && other.sending[q] || self.receiving[q] && other.receiving[q])
        })
    }
    /// Adds `other`'s sends and receives (see [`Exchange::can_take`]).
    pub(crate) fn take(&mut self, other: Exchange<'b, B>) {
        for q in 0..MAX_GPUS {
            self.sending[q] |= other.sending[q];
            self.receiving[q] |= other.receiving[q];
            self.blocks[q] = self.blocks[q].max(other.blocks[q]);
        }
        self.sends.extend(other.sends);
        self.recvs.extend(other.recvs);
    }
}

impl<B: Backend> Comm<B> {
    /// Sends `data` to world rank `peer`, which receives it with [`Comm::recv`] (cudarc's
    /// `Comm::send`). The data is staged through this rank's scratch, or, where it lies in
    /// a registered or symmetric buffer ([`Comm::register`], [`Comm::alloc_symmetric`]),
    /// read there in place by the peer; the two ranks synchronise alone: ranks not
    /// involved never wait. As with NCCL, a send returns
    /// on the host at once, but its kernel waits for the receive: two ranks that each
    /// send to the other first, or a ring of sends, make them in one [`Comm::group`].
    /// A receive that expects another type, length or sender is
    /// [`Error::CallMismatch`] on both ranks, nothing received.
    ///
    /// ```
    /// use peercomm::backend::{host::Host, Backend};
    /// use peercomm::{Comm, CommConfig, UniqueId};
    ///
    /// let id = UniqueId::new()?;
    /// std::thread::scope(|s| {
    ///     for rank in 0..2 {
    ///         let id = &id;
    ///         s.spawn(move || {
    ///             let comm = Comm::from_rank(Host::open(rank).unwrap(), rank, 2, id, CommConfig::default()).unwrap();
    ///             let dev = comm.device();
    ///             if rank == 0 {
    ///                 let tokens = Host::alloc_from(dev, &[7u32, 8, 9]).unwrap();
    ///                 comm.send(&tokens, 1).unwrap();
    ///             } else {
    ///                 let mut tokens = Host::alloc_buffer::<u32>(dev, 3).unwrap();
    ///                 comm.recv(&mut tokens, 0).unwrap();
    ///                 comm.synchronize().unwrap();
    ///                 assert_eq!(Host::download(dev, &tokens).unwrap(), vec![7, 8, 9]);
    ///             }
    ///             comm.synchronize().unwrap();
    ///         });
    ///     }
    /// });
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn send<S: DeviceBuffer<B>>(&self, data: &S, peer: usize) -> Result<()> {
        self.send_with(data, peer, &CollectiveOptions::new())
    }

    /// As [`Comm::send`], with options: over groups of `group_size`, `peer` is a member
    /// of this rank's group (world rank `group start + peer`); `blocks` sets the blocks
    /// that move the pair's data, which the receive must ask alike (else
    /// [`Error::CallMismatch`]); the algorithm is `Auto` or `OneStage`.
    pub fn send_with<S: DeviceBuffer<B>>(
        &self,
        data: &S,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let mut x = Exchange::default();
        self.add_send(&mut x, data, peer, options)?;
        self.launch_exchange(x)
    }

    /// Receives into `buf` what world rank `peer` sends with [`Comm::send`] (cudarc's
    /// `Comm::recv`): the same type and element count.
    pub fn recv<R: DeviceBufferMut<B>>(&self, buf: &mut R, peer: usize) -> Result<()> {
        self.recv_with(buf, peer, &CollectiveOptions::new())
    }

    /// As [`Comm::recv`], with the options of [`Comm::send_with`].
    pub fn recv_with<R: DeviceBufferMut<B>>(
        &self,
        buf: &mut R,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let mut x = Exchange::default();
        self.add_recv(&mut x, buf, peer, options)?;
        self.launch_exchange(x)
    }

    /// All-to-all in equal parts: `send` and `recv` hold `world x n` elements; part q of
    /// `send` (elements `[q * n, (q + 1) * n)`) goes to rank q, and part q of `recv`
    /// receives rank q's part for this rank, so the rows of each peer land in rank order.
    pub fn all_to_all<S, R>(&self, send: &S, recv: &mut R) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_to_all_with(send, recv, &CollectiveOptions::new())
    }

    /// As [`Comm::all_to_all`], with the options of [`Comm::send_with`]: over groups of
    /// `group_size`, among the members of this rank's group (`group width x n`
    /// elements, part q for member q).
    pub fn all_to_all_with<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let counts = self.equal_parts(send.len(), options)?;
        self.all_to_all_v_with(send, &counts, recv, &counts, options)
    }

    /// The counts of an all-to-all of `len` elements in equal parts over the group of
    /// `options`.
    pub(crate) fn equal_parts(
        &self,
        len: usize,
        options: &CollectiveOptions,
    ) -> Result<Vec<usize>> {
        let width = self.peers(options)?.width;
        if !len.is_multiple_of(width) {
            let what = format!(
                "all-to-all input of {len} elements: not a multiple of the group width ({width})"
            );
            return Err(Error::LengthMismatch {
                rank: self.rank(),
                what,
            });
        }
        Ok(vec![len / width; width])
    }

    /// All-to-all with a count per peer (expert parallelism's dispatch and combine, the
    /// counts the router produced): `send_counts[q]` elements go to rank q, taken from
    /// `send` in rank order (part q starts after the parts for ranks below q), and
    /// `recv_counts[q]` elements come from rank q, placed in `recv` in rank order. Rank
    /// q's `send_counts[r]` must equal rank r's `recv_counts[q]`: a pair whose counts or
    /// types differ is [`Error::CallMismatch`] on both of its ranks, which receive
    /// nothing, and the ranks they exchange with are told at once
    /// ([`Error::PeerAborted`]; what those received from the other ranks may have been
    /// written). A count of 0 both ways leaves that pair out.
    pub fn all_to_all_v<S, R>(
        &self,
        send: &S,
        send_counts: &[usize],
        recv: &mut R,
        recv_counts: &[usize],
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let options = CollectiveOptions::new();
        self.all_to_all_v_with(send, send_counts, recv, recv_counts, &options)
    }

    /// As [`Comm::all_to_all_v`], with the options of [`Comm::all_to_all_with`]: over
    /// groups, a count per member of this rank's group.
    pub fn all_to_all_v_with<S, R>(
        &self,
        send: &S,
        send_counts: &[usize],
        recv: &mut R,
        recv_counts: &[usize],
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let mut x = Exchange::default();
        self.add_all_to_all_v(&mut x, (send, send_counts), (recv, recv_counts), options)?;
        self.launch_exchange(x)
    }

    /// The peers a point-to-point call with `options` reaches: the members of this
    /// rank's group, in this rank's peer-memory world.
    pub(crate) fn peers(&self, options: &CollectiveOptions) -> Result<Peers> {
        let world = self.world_size();
        if self.core.settings.world != world {
            return Err(Error::Unsupported(
                "send / recv and all-to-all between hosts (peer memory serves one host)".into(),
            ));
        }
        if !matches!(options.algorithm, Algorithm::Auto | Algorithm::OneStage) {
            return Err(Error::Unsupported(format!(
                "send / recv and all-to-all run one kernel (the exchange), not {}; use Auto \
                 or OneStage",
                options.algorithm.name()
            )));
        }
        let width = self.core.settings.group_width(options.group_size)?;
        let blocks = match options.blocks {
            Some(_) => Some(self.core.settings.blocks(options.blocks, || 1)?),
            None => None,
        };
        Ok(Peers {
            base: self.rank() / width * width,
            width,
            blocks,
        })
    }

    /// The world rank of member `peer` of `peers`' group.
    fn world_rank(peers: &Peers, peer: usize) -> Result<usize> {
        match peer < peers.width {
            true => Ok(peers.base + peer),
            false => Err(Error::InvalidPeer {
                peer,
                world: peers.width,
            }),
        }
    }

    pub(crate) fn add_send<'b, S>(
        &self,
        x: &mut Exchange<'b, B>,
        data: &'b S,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
    {
        let peers = self.peers(options)?;
        let q = Self::world_rank(&peers, peer)?;
        self.add_sends(x, data, vec![(q, 0..data.len())], peers.blocks)
    }

    pub(crate) fn add_recv<'b, R>(
        &self,
        x: &mut Exchange<'b, B>,
        buf: &'b mut R,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B>,
    {
        let peers = self.peers(options)?;
        let q = Self::world_rank(&peers, peer)?;
        let len = buf.len();
        self.add_recvs(x, buf, vec![(q, 0..len)], peers.blocks)
    }

    /// Adds an all-to-all-v's sends and receives: (buffer, counts per group member).
    pub(crate) fn add_all_to_all_v<'b, S, R>(
        &self,
        x: &mut Exchange<'b, B>,
        (send, send_counts): (&'b S, &[usize]),
        (recv, recv_counts): (&'b mut R, &[usize]),
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let core = &*self.core;
        core.check_pair(&meta(send), &meta(&*recv))?;
        let peers = self.peers(options)?;
        let width = peers.width;
        let parts =
            |counts: &[usize], len: usize, which: &str| -> Result<Vec<(usize, Range<usize>)>> {
                let rank = self.rank();
                if counts.len() != width {
                    let what = format!("{} {which} counts for a group of {width}", counts.len());
                    return Err(Error::LengthMismatch { rank, what });
                }
                let mut at = 0usize;
                let mut parts = Vec::with_capacity(width);
                for (q, &n) in counts.iter().enumerate() {
                    let end = at.checked_add(n).filter(|&e| e <= len).ok_or_else(|| {
                        let what =
                            format!("the {which} counts add up to more than its {len} elements");
                        Error::LengthMismatch { rank, what }
                    })?;
                    parts.push((peers.base + q, at..end));
                    at = end;
                }
                Ok(parts)
            };
        let sends = parts(send_counts, send.len(), "send")?;
        let recvs = parts(recv_counts, recv.len(), "receive")?;
        self.add_sends(x, send, sends, peers.blocks)?;
        self.add_recvs(x, recv, recvs, peers.blocks)
    }

    fn add_sends<'b, S>(
        &self,
        x: &mut Exchange<'b, B>,
        buf: &'b S,
        parts: Vec<(usize, Range<usize>)>,
        blocks: Option<u32>,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "send")?;
        meta(buf).bytes(self.rank(), "send")?;
        for (q, _) in &parts {
            if std::mem::replace(&mut x.sending[*q], true) {
                return Err(twice("send to", *q));
            }
            x.blocks[*q] = x.blocks[*q].max(blocks);
        }
        x.sends.push(Parts {
            buf: buf as &dyn DeviceBuffer<B>,
            parts,
        });
        Ok(())
    }

    fn add_recvs<'b, R>(
        &self,
        x: &mut Exchange<'b, B>,
        buf: &'b mut R,
        parts: Vec<(usize, Range<usize>)>,
        blocks: Option<u32>,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B>,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "receive")?;
        meta(&*buf).bytes(self.rank(), "receive")?;
        for (q, _) in &parts {
            if std::mem::replace(&mut x.receiving[*q], true) {
                return Err(twice("receive from", *q));
            }
            x.blocks[*q] = x.blocks[*q].max(blocks);
        }
        x.recvs.push(Parts {
            buf: buf as &mut dyn DeviceBufferMut<B>,
            parts,
        });
        Ok(())
    }

    /// Checks the exchange as a whole (a send to this rank itself needs its receive, of
    /// the same type and length; no buffer written overlaps another), then launches it.
    pub(crate) fn launch_exchange(&self, x: Exchange<'_, B>) -> Result<()> {
        let core = &*self.core;
        let (dev, rank) = (core.device(), self.rank());
        let mut ops = [PeerOps::default(); MAX_GPUS];
        for (o, &blocks) in ops.iter_mut().zip(&x.blocks) {
            o.blocks = blocks;
        }
        let mut spans = Vec::new();
        let mut guards = Vec::new();
        for s in &x.sends {
            let (ptr, access) = s.buf.read_ptr(dev);
            guards.push(access);
            let dtype = s.buf.dtype();
            for (q, r) in &s.parts {
                let t = transfer(ptr, dtype, r);
                spans.push(span(rank, "send", &t, false));
                ops[*q].send = Some(t);
                // A registered or symmetric part: the peer reads it in place.
                if *q != rank && t.elements > 0 {
                    let seen = self.registry.seen_by(t.ptr, t.elements * dtype.size());
                    ops[*q].send_remote = seen.map_or(0, |at| at[*q]);
                }
            }
        }
        for r in x.recvs {
            let dtype = r.buf.dtype();
            let (ptr, access) = r.buf.write_ptr(dev);
            guards.push(access);
            for (q, range) in &r.parts {
                let t = transfer(ptr, dtype, range);
                spans.push(span(rank, "receive", &t, true));
                ops[*q].recv = Some(t);
            }
        }
        let own = &ops[rank];
        if let (Some(s), Some(r)) = (own.send, own.recv) {
            if s.dtype != r.dtype {
                return Err(Error::DTypeMismatch {
                    rank,
                    expected: s.dtype,
                    got: r.dtype,
                });
            }
            if s.elements != r.elements {
                let what = format!(
                    "sends itself {} elements but receives {}",
                    s.elements, r.elements
                );
                return Err(Error::LengthMismatch { rank, what });
            }
        } else if own.send.is_some() || own.recv.is_some() {
            return Err(Error::Unsupported(format!(
                "rank {rank} sends to or receives from itself without the other half in the same exchange (a group)"
            )));
        }
        check_overlaps(&spans, false)?;
        core.exchange(&ops)
    }
}

fn twice(what: &str, q: usize) -> Error {
    Error::Unsupported(format!(
        "a second {what} rank {q} in one group: make it in another group"
    ))
}

fn transfer(ptr: u64, dtype: crate::DType, r: &Range<usize>) -> Transfer {
    Transfer {
        ptr: ptr + (r.start * dtype.size()) as u64,
        dtype,
        elements: r.len(),
    }
}

fn span(rank: usize, which: &'static str, t: &Transfer, written: bool) -> Span {
    Span {
        rank,
        which,
        ptr: t.ptr,
        bytes: t.elements * t.dtype.size(),
        written,
    }
}
