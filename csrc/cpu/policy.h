// The CPU tuning constants and the cost model's constants, in one place, each with the
// measurement behind it. The cost model ranks strategies; it need not be exact, only right about
// which is cheaper.
#pragma once

#include <cstdint>

namespace scatter_add {
namespace cpu {

struct CpuPolicy {
  // --- threads -------------------------------------------------------------------------------
  // Below this many bytes of memory traffic per thread, fewer threads are used: an OpenMP fork
  // and join costs about what a copy of 64 KiB takes on one core. Intel Xeon with AMX (2 vCPUs),
  // C++, medians: a fork and join of two threads 1.0-1.1 us back to back, 2-14 us when the
  // caller had run alone for 5 ms (the other thread asleep); a copy of 64 KiB 1.7-2.0 us, of
  // 16 KiB 0.1-0.2 us, of 256 KiB 6.5-7.7 us.
  static constexpr int64_t kMinBytesPerThread = 64 << 10;
  // The same for the walks that add whole rows at cache speed: the planned walk (bytes: its
  // Splitter's total, D element-size per row-transfer) and the direct walk of rows wide enough to
  // split by columns (K D element-size 3); and for gather (2 K D element-size; a planned gather,
  // its rows' copies). From one and two threads in a loop over small, cache-resident calls
  // through the Python API (2-vCPU EPYC, medians of 9 batches). Wide float32/float64 rows add at
  // cache speed, so a second thread pays from about 512 KiB: float32 N = K = 128 D = 256 (384 KiB)
  // 5.6 us on one thread, 6.6-6.8 on two; N = K = 32 D = 1024 (384 KiB) 5.3-5.5 against 5.3-5.6;
  // from 768 KiB two won (N = K = 64 D = 1024 9.2-9.7 -> 7.2-7.5 us). bf16/fp16 sum in a float32
  // scratch and pay from about 192 KiB: N = K = 16 D = 1024 (96 KiB) 4.8-5.1 us against 4.8-5.2,
  // N = 4096 K = 16 D = 1024 6.2 against 6.3, N = K = 32 D = 1024 (192 KiB) 7.9-8.1 -> 6.6 us.
  // gather: float32 N = 16 K = 16 D = 1024 (128 KiB) 4.2 us on one thread, 4.8 on two; K = 8
  // D = 4096 (256 KiB) 6.0 -> 5.5 us. On a Zen 5 EPYC (AVX-512, 2 vCPUs; the same loops, best of 9
  // batches of 300, torch.set_num_threads 1 and 2 alternated twice), a gather of 256 KiB was
  // 1.10-1.14x slower on two threads (float32 N = K = 32 D = 1024 2.92 -> 3.32 us, bf16 N = 16 and
  // 4096 K = 16 D = 4096; float32 N = 1 K = 8 D = 4096 2.50 -> 2.91-2.97 us in a loop alternated
  // with index_select, 0.52-0.74x of index_select in the shape sweep), of 512 KiB 0.82-0.97x
  // (float32 K = 64 D = 1024 4.50 -> 3.85 us), of 1 MiB 0.65-0.67x: so a second gather thread from
  // 512 KiB. (Two-thread times on that VM swing between runs: the same 512 KiB gathers took
  // 0.74-0.97x in one later run and 1.14-1.42x in another.) The row walks there kept theirs:
  // float32 at 768 KiB 0.88-1.12x, from 1.5 MiB 0.53-0.74x; bf16 from 384 KiB 0.81-0.90x.
  static constexpr int64_t kRowsMinBytesPerThread = 256 << 10;
  static constexpr int64_t kRows16MinBytesPerThread = 96 << 10;
  static constexpr int64_t kGatherMinBytesPerThread = 256 << 10;
  // A gather's rows read at random from an x of kGatherRandomRowsFromBytes or more count
  // kGatherRandomRowBytes each besides their bytes, toward its threads: such a row is a cache
  // and TLB miss, which a second thread overlaps. Intel Xeon with AMX (2 vCPUs, 2 MiB L2 each),
  // float32, x of 16 MB, medians of 300 calls through the Python API, one thread -> two (torch's
  // index_select on two): D = 4 K = 4000 15.8 -> 11.4 us (16.9), K = 6000 23.7 -> 15.6 (24.7),
  // K = 10000 35.8 -> 22.3 (23.9); D = 8 K = 3000 15.1 -> 12.0 (12.4), K = 10000 40.7 -> 24.2
  // (25.7); up to K = 3000 at D = 4 (11.4 us, index_select 12.9) one thread stays. The same
  // rows from an x of 4 MB (just under 4 MiB) took about half the time (D = 1 K = 10000 16.6 us;
  // from 16 MB 35.6). A row of several lines from such an x counts twice its bytes when that is
  // more (gather.cpp): its lines come from memory too, and one thread had taken such gathers up to
  // 336 KiB of copy. The same Xeon, C++, float32, x of 16 MiB, 32 MiB of other data written
  // before each call, medians of 301, one thread -> two: K = 328 D = 128 24.6-26.7 -> 16.5-17.4
  // us, K = 164 D = 256 23.6-28.5 -> 17.1-18.9, K = 41 D = 1024 17.0-17.3 -> 12.7-13.6, K = 655
  // D = 64 19.9-22.3 -> 13.5-16.7 (K = 164 D = 128 stays on one thread, 12.5-13.8; two 11.1). Through
  // the op, two threads, interleaved with index_select (in brackets), three processes each, the
  // build before -> this rule: K = 328 D = 128 11.6-14.9 (10.2-12.5) -> 7.4-10.6 (7.3-10.1) us;
  // K = 655 D = 64 12.2-13.0 (11.5-12.4) -> 7.2-10.4 (7.4-10.6) us. Rows of 16 and 32 bytes keep
  // their threads (D = 4 K = 3000 and 4000, D = 8 K = 3000: the same pick before and after).
  static constexpr int64_t kGatherRandomRowsFromBytes = 4 << 20;
  static constexpr int64_t kGatherRandomRowBytes = 128;

  // --- gather ----------------------------------------------------------------------------------
  // An unweighted gather writes its dst rows with non-temporal stores (no read of each dst line
  // into the cache before it is overwritten) when dst has at least kStreamAboveBytes in rows of
  // kStreamMinRowBytes to kStreamMaxRowBytes, and its pages are in memory already
  // (kResidentSamples pages checked: on fresh pages streaming is slower, gather.cpp). A row copy
  // loop into a dst written before, 2 threads, wall time, memcpy -> streaming: 4 MiB of 256 B to
  // 8 KiB rows 1.3-1.7x faster, 16 to 128 MiB 1.2-2.1x; but 1 MiB of 16 KiB rows 0.58x (a dst
  // that stays in the cache), 128 B rows 0.99x, 64 B 0.81x. Through torch, rows of 8 and 16 KiB
  // from a few cached source rows took 1.05-1.2x longer (memcpy's string moves already skip the
  // read for such lengths).
  // That was measured on a Xeon. On AMD's Zen cores (an EPYC VM, 32 MiB L3, 2 threads, dst
  // written by the previous call) a dst that fits in the L3 with the source rows it reads stays
  // there between calls, and plain stores into it beat streaming, which sends every row to
  // memory. The sweep's gather cells, ours streamed against torch's index_select: 8 MiB of 256 B
  // to 2 KiB rows from a few source rows 317-350 us against 73-108 us (0.23-0.45x), 16 MiB
  // 0.40-0.64x; ours with plain stores, best of three medians: bf16 N = 4 K = 4096 D = 1024
  // 104.9 us (streamed 318.6, index_select 94.6), N = 33 K = 32768 D = 128 109.6 us (320.6,
  // 130.6). With a source of 16 MiB beside a 16 MiB dst streaming still won (1.19-1.49x of
  // index_select, plain 0.9-1.1x). So on AMD a dst streams only when dst and source rows
  // together fill the L3 (gather.cpp, stream_pays); kAssumedL3Bytes where sysfs does not say.
  // And only with the AVX-512 kernels (64-byte streaming stores): on an EPYC without AVX-512
  // (2 vCPUs, 32 MiB L3) the AVX2 kernels' streaming lost at every size tried, a new dst per
  // call as index_select has, medians of 25 alternated calls, plain -> streamed (index_select):
  // float32 N = K = 16384 D = 256 615 -> 916 us (598-690), N = K = 4096 D = 1024 790 -> 910 us
  // (661-808), N = K = 32768 D = 128 847 -> 938 us (890-947), bfloat16 N = K = 16384 D = 256
  // 233 -> 290 us (244-266); 64 MiB results, where page faults of the new dst take most of the
  // call, 23.0 -> 25.5 ms and 27.0 -> 29.6 ms (float32 D = 256 and D = 64), 128 MiB 49.0 -> 47.6
  // ms (D = 1024).
  // Later, on a Zen 5 EPYC (AVX-512, 32 MiB L3, 2 vCPUs), the same sweep's way (a new dst per
  // call, x reused), ours alternated with index_select in one process, ours' speedup in three
  // runs of each mode, plain / streamed: where x is no larger than the dst
  // (16 MiB each) plain won, float32 N = K = 4096 D = 1024 1.00 / 0.68-0.71x, N = K = 65536 D = 64
  // 1.26-1.32 / 0.75-0.78x, bfloat16 N = K = 8192 D = 1024 0.98-1.00 / 0.64-0.73x; 24 MiB each
  // about even (0.95-1.02 / 0.87-1.11x). Streaming won where the rows come from an x far larger
  // than the L3: a 16 MiB dst of 1 KiB rows from x of 390 MiB 0.98-1.08 / 1.11-1.13x, 976 MiB
  // 0.97-0.99 / 1.14-1.17x, 1.9 GiB 0.98-1.02 / 1.08-1.13x, bfloat16 976 MiB 1.02-1.06 /
  // 1.09-1.11x; but not from x of 195 MiB in 2 KiB rows (1.02-1.10 / 0.93-1.03x), nor with 4 KiB
  // rows (976 MiB: 0.91-1.02 / 0.82-0.91x), nor with 256 B rows (488 MiB: 1.34-1.66 /
  // 1.21-1.27x), nor into an 8 MiB dst (1.03-1.05 / 0.73-0.75x). From x of 488-976 MiB rows of
  // 512 B and 2 KiB won too (1.07-1.15 / 1.22-1.28x, 0.99-1.09 / 1.15-1.21x). So on AMD x must
  // span kStreamSourceL3s L3s, and rows take kStreamMinRowBytesL3 to kStreamMaxRowBytesL3.
  // Later, on an Intel Xeon with AMX (480 MiB of L3 by sysfs, 2 vCPUs), float32 rows of 4 KiB,
  // torch's allocator (glibc hands a freed block of under 32 MiB to the next call, so the dst is
  // in memory and is streamed), medians, plain -> streamed: a gather called alone in a loop,
  // writing into its own previous result, 4 MiB 154-169 -> 130-131 us, 8 MiB 295-302 -> 298-322,
  // 16 MiB 593-628 -> 585-689, 24 MiB 909-957 -> 865-870, 31 MiB 1461-1513 -> 1166-1168; but
  // interleaved with index_select and x[idx] (the sweep's way: the dst block another op wrote
  // just before, its lines dirty in the cache, which a streaming store writes back first)
  // 4 MiB 171-188 -> 381-382 us, 8 MiB 314-324 -> 732-744, 16 MiB 623-650 -> 1342-1417,
  // 24 MiB 1075-1085 -> 2003-2068, 31 MiB 1677-1780 -> 2407-2470, and index_select after it
  // slower too. In a model the allocator's blocks come back from other ops, as in the second
  // loop. A dst kept in memory from 32 MiB up (a C++ caller's, or malloc told to keep it) gained
  // alone, 32 MiB 980-1355 -> 753-782 us, 64 MiB 4034-4071 -> 1540-1564 us (from x of 781 MiB:
  // 2374-3070 -> 1397-1574, 6006-6640 -> 2946-3538). So on CPUs without the L3 rule above a dst
  // streams from kStreamAboveBytesNoL3. (An earlier Xeon with 300 MiB of L3 had gained 1.3-1.7x
  // from 4 MiB in the first kind of loop.)
  static constexpr int64_t kStreamAboveBytes = 4 << 20;
  static constexpr int64_t kStreamAboveBytesNoL3 = 32 << 20;
  static constexpr int64_t kAssumedL3Bytes = 32 << 20;
  static constexpr int64_t kStreamMinRowBytes = 256;
  static constexpr int64_t kStreamMaxRowBytes = 4096;
  static constexpr int64_t kStreamMinRowBytesL3 = 512;
  static constexpr int64_t kStreamMaxRowBytesL3 = 2048;
  static constexpr int64_t kStreamSourceL3s = 8;
  // The L3 of every AMD EPYC measured above (sysfs's cache index3); the pages-in-memory test reads
  // kResidentSamples pages of dst by mincore, a system call each, for a dst of 4 MiB or more.
  static constexpr int kResidentSamples = 8;

  // --- gather: by the index or by a plan ------------------------------------------------------
  // gather_rows copies by the index unless a strategy is forced (choose_gather): a plan built for
  // the call (count or radix) reads each x row once, but pays its sort and writes its rows'
  // destinations at random. Intel Xeon with AMX (2 vCPUs, 300 MiB L3), float32, the C++ API,
  // medians of 15 alternated rounds (us), by the index / plan by count / plan by radix, two
  // threads: uniform N = K = 65536 D = 64 854 / 1870 / 2688; zipf N = 100k K = 1M D = 8
  // 2333 / 16360 / 29194; every entry in one row, N = 1000 K = 100k D = 256 4752 / 14836 / 14648;
  // MoE top-2 rows N = 4096 K = 8192 D = 1024 1470 / 1937 / 1424; N = 16 K = 16384 D = 256
  // 560 / 1034 / 1098; N = 1M K = 100k D = 1 186 / 3881 / 2305; N = 1000 K = 1M D = 1
  // 1050 / 9838 / 16282; sorted N = K = 16384 D = 256 735 / 794 / 858; N = K = 64 D = 4096
  // 17.5 / 19.8 / 19.5. One thread: the same order everywhere but MoE top-2 (2625 / 4263 / 2484)
  // and N = K = 64 D = 4096 (37.3 / 36.8 / 36.7), within 5%. So no shape is priced.

  // --- planned rows (count / radix) ----------------------------------------------------------
  // index_add_rows builds its plans in a per-thread plan whose buffers it keeps up to this size
  // (a plan of about a million entries), so each thread that makes planned calls may hold that
  // much between them; a larger plan, or one whose build failed, is released. A bound on memory
  // held, not a tuned speed: a plan past it is built in new pages on every call (their faults
  // are the cost measured at kKeptScratchBytes and at big_alloc's huge pages below).
  static constexpr int64_t kKeptPlanBytes = 32 << 20;
  // The same for the direct walk's float32 scratch, its snapshot and its row marks and bitmaps
  // (one column of 2M bf16 rows, or 32 columns of 64k rows).
  static constexpr int64_t kKeptScratchBytes = 32 << 20;
  // Buffers of this size and more are mapped in huge pages where the system allows (big_alloc.h):
  // a scratch larger than kKeptScratchBytes is new memory on every call, which the kernel faulted
  // in 4 KiB at a time. Zen 5 EPYC (transparent huge pages on "madvise"), the C++ API, the pick on
  // two threads, two rounds alternating the builds, bf16 uniform unless named: N = K = 786432
  // D = 16 20.2-20.7 -> 8.8-10.1 ms, N = K = 1M D = 16 26.6-27.1 -> 15.0-17.8 ms, D = 8 zipf
  // 20.5-20.8 -> 11.2-13.1 ms, N = K = 3M D = 4 46.5-47.7 -> 36.0-38.1 ms, N = K = 2M D = 8
  // 56.7-57.0 -> 47.2-54.8 ms; the direct walk forced on N = K = 65536 D = 256 (a 64 MiB
  // scratch), one thread, 32.3 -> 12.2 ms. What stays is the kernel zeroing each new page. A
  // plan's buffers past kKeptPlanBytes ask for huge pages too (reserve_huge): a counting sort's
  // call forced on two threads, float32, N = K = 2M D = 16 60.0-63.2 -> 45.4-46.7 ms, N = K = 4M
  // D = 4 126.5-128.2 -> 101.5-103.9 ms; N = 300k K = 3M D = 64 (the pick) 40.4-51.1 -> 37.0-38.2 ms;
  // N = 1M K = 4M D = 16 61.4-63.2 -> 61.4-61.9 ms.
  static constexpr int64_t kHugePagesFromBytes = 4 << 20;
  // bf16/fp16, a slot per row: rows of up to this many columns find the rows to write back by
  // comparing the scratch with a snapshot rather than by marking rows as they are added. K = 1M,
  // one thread, thread CPU time, marks -> snapshot: D = 1 N = 100k 5.0-5.1 -> 2.5 ms, N = 300k
  // 4.2-4.3 -> 2.1-2.8 ms, N = 1M 6.2-7.0 -> 4.5-5.1 ms; best of six alternated runs, D = 2 N =
  // 1M 0.69-0.73x of the time, N = 100k 0.75x, N = 4096 K = 65536 0.82x; D = 3 0.81-0.88x; D = 4
  // 0.95-1.18x and D = 8, 16 0.98-1.06x (no gain).
  static constexpr int64_t kSnapshotMaxCols = 3;
  // One bf16/fp16 column takes a slot per row (dense) also when N is up to this many times K:
  // copying every row in costs less than finding the rows that repeat. Two threads, medians of 9
  // batches, uniform index unless named, sparse or touched -> dense (index_add_): K = 100k, N =
  // 150k 0.72 -> 0.36 ms (0.54), 200k 0.69 -> 0.47 ms (0.57-0.59), 300k 0.69 -> 0.63 ms (0.62-0.63),
  // 200k zipf 0.42 -> 0.37 ms (0.49-0.50), fp16 250k 0.84 -> 0.64 ms (0.60); K = 10k, N = 20k
  // 51-52 -> 31 us (46), 30k 55-57 -> 35 us (50); K = 1M, N = 2M 8.1 -> 5.5-5.7 ms (8.0-9.2), 3M
  // 7.6-7.7 -> 7.0 ms (9.2-14). At N = 400k, K = 100k dense was slower (0.72 -> 0.79 ms). The cost
  // model still prices these shapes as the walk they replace, which is slower.
  // Later rows of up to kDenseMaxCols columns too: on a Zen 5 EPYC (AVX-512), two builds alternated
  // in one process, 2 threads, medians of 9 paired rounds, quartiles of the ratio, touched ->
  // dense, bf16 uniform, K = 100k: D = 2 N = 120k / 150k / 300k 0.41-0.42x / 0.46x / 0.59-0.60x
  // (index_add_ then 1.9x / 1.7x / 1.2x slower than ours, 0.77-0.84x before), zipf N = 150k
  // 0.85-0.87x; D = 3 N = 150k 0.59-0.61x; D = 4 N = 150k / 250k 0.74-0.76x / 0.60x; D = 8 0.69-0.70x
  // / 0.79-0.82x, zipf 0.87-0.91x; D = 16 N = 150k 0.61-0.63x; fp16 D = 6 0.66x; K = 1M D = 2
  // N = 2M 0.70-0.76x; but cached shapes even, K = 20k D = 16 N = 30k 0.97-0.98x, N = 50k
  // 1.04-1.05x. One thread walking alone, D = 2 N = 150k took 843 us touched, 8 ns an entry
  // (index_add_ 408 us). But beyond kDenseMaxBytes of slots copying every row in lost (one build
  // against the other in one C++ harness, 2 threads, medians of 7, before -> dense): K = 1M D = 2
  // N = 3M (24 MB of slots) 7.3 -> 8.1 ms, D = 4 N = 2.5M (40 MB) 10-13 -> 24-28 ms, D = 16 N = 3M
  // 25-29 -> 78-103 ms; K = 100k D = 16 N = 290k / 300k (19 MB) 0.64 -> 1.25 ms, 0.63 -> 1.1 ms;
  // where D = 2 N = 2M (16 MB) won (above), D = 16 N = 200k (13 MB) 0.67 -> 0.55 ms.
  static constexpr int64_t kDenseRowsPerEntry = 3;
  static constexpr int64_t kDenseMaxCols = 16;
  static constexpr int64_t kDenseMaxBytes = 16 << 20;
  // bf16/fp16 with more rows than entries: rows of at most kTouchedMaxCols columns whose float32
  // slots, one per row, take at most kTouchedMaxBytes sum in touched slots (a slot per row, filled
  // from out by the row's first contribution and written back by a bitmap of the rows touched)
  // rather than sparse ones (a pass over the index first finds the rows named more than once,
  // and the walk ranks each of those in two bitmaps for its slot), where rows repeat: a load of
  // at least kTouchedMinLoad entries per row (sampled_load: K / N, or for K of kLoadSampleMinEntries
  // and more whose K / N is lower, K times the chance that two of kLoadSamples sampled entries
  // share a row). Two threads, wall time, best of 50 calls, each after 64 MiB of other writes
  // (cold caches), alternated, sparse -> touched, D = 1, K = 100k: uniform N = 150k 933-950 ->
  // 725-734 us, N = 200k 892-906 -> 716-719 us; zipf N = 1M 971-1036 -> 589-754 us; but uniform
  // N = 300k 809-811 -> 975-1403 us, N = 500k 834-927 -> 1032-1259 us, N = 1M even (828-929,
  // 818-841 us). With warm caches touched won at every load (one thread, best of 100: N = 1M
  // 614-895 -> 525-531 us) but lost where its slots outgrow the caches: N = 4M 848-854 ->
  // 1466-1635 us; D = 2 N = 1M 1008-1011 -> 1476-1532 us. Rows of 2 to 16 columns, warm, N = 150k
  // K = 100k: D = 2 / 4 / 8 1431-1435 -> 1009-1086, 1580-1601 -> 1010-1139, 1547-1583 ->
  // 1183-1215 us; D = 16 N = 50k K = 40k 572 -> 404 us; D = 4 N = 300k K = 30k (load 0.1) 372-383
  // -> 468-512 us. The sample (4096 entries into a 128 KiB table) takes about 10 us (N = 1M,
  // K = 100k, warm), so only calls of 64k entries and more (several hundred us) take it.
  static constexpr int64_t kTouchedMaxCols = 16;
  static constexpr int64_t kTouchedMaxBytes = 6 << 20;
  static constexpr double kTouchedMinLoad = 0.5;
  static constexpr int64_t kLoadSamples = 4096;
  static constexpr int64_t kLoadSampleMinEntries = 65536;
  // Work split: a destination row costs (its contributions + kRowCost) row-transfers, since the
  // row is read and written once. Split points inside a row fall on kColumnAlign elements
  // (128 B of bf16, a multiple of every vector width) so threads never share a cache line
  // except at unaligned row ends.
  static constexpr int64_t kRowCost = 2;
  static constexpr int64_t kColumnAlign = 64;

  // --- the cost model (choose.cpp), nanoseconds on one thread ----------------------------------
  // Fitted to `bench_scatter_add --calibrate` (140 shapes: D 1..4096 x N/K 1/100..100 x float32 /
  // bfloat16 x uniform / power-law index, every strategy timed in thread CPU time) on a 2-core
  // Xeon (Sapphire Rapids) by minimising the regret of the pick (its time over the best
  // strategy's). `bench_scatter_add --evaluate benchmarks/cpu_calibration.csv` re-scores the
  // calibration these constants were fitted to:
  // geometric-mean regret 1.02x, worst 1.39x, where timings of one shape vary by up to 1.5x
  // between runs. The same grid measured again after the bf16/fp16 direct walk and the plan
  // build got faster (kept scratch, snapshot, column kernels, 32-bit counts) scores the same
  // constants at 1.009x, worst 1.22x (bfloat16 N = 16384 K = 163 D = 256 and float32 N = 1638
  // K = 16384 D = 256), so they were not refitted. An AMD EPYC's calibration
  // (benchmarks/cpu_calibration_epyc.csv, Zen cores, 1 MiB L2, 32 MiB L3; each time the least
  // of three runs) scores them at 1.034x, worst 2.08x at float32 N = 1638 K = 16384 D = 256 (out
  // in the L2/L3, priced as memory by the one cache tier of kCacheBytes). `bench_scatter_add
  // --fit` over both calibrations finds no constant whose change (x0.5 to x2) lowers their mean
  // regret by 0.01%: the constants sit at a minimum for one-at-a-time moves (with any gain kept,
  // kNsPerByteStream x0.7 and kCountNsPerRow x0.5 move the Xeon 1.021 -> 1.022x and the EPYC
  // 1.035 -> 1.032x). A second cache tier for random rows, 2 to 64 MB at 0.002 to 0.03 ns per
  // byte, takes the EPYC to 1.022x at best but the Xeon to 1.034-1.069x (and one for the direct
  // walk's rows alone scored 1.041-1.055x on both): no one set of constants serves both CPUs
  // better than these.
  // Per index entry: the direct walk (float32/float64; bf16/fp16 with a dense scratch; bf16/fp16
  // with a sparse one) and the planned walk; per destination row of the planned walk.
  static constexpr double kDirectNsPerEntry = 1.45;
  static constexpr double kDirect16NsPerEntry = 3.69;
  static constexpr double kDirect16SparseNsPerEntry = 9.96;
  static constexpr double kPlannedNsPerEntry = 0.0;
  static constexpr double kPlannedNsPerRow = 15.0;
  // Per byte: streamed from memory, read and written in cache, read or written at a random row in
  // memory (plus a fixed cost per such row, for destination rows and for source rows).
  static constexpr double kNsPerByteStream = 0.0413;
  static constexpr double kNsPerByteCached = 0.0035;
  static constexpr double kNsPerByteMemory = 0.0306;
  static constexpr double kNsPerRandomRow = 2.06;
  static constexpr double kNsPerRandomSourceRow = 18.7;
  // A planned walk's source row in cache still costs its sort and gather: the counting sort's
  // path took 4 to 6 ns per entry at D <= 16 with sources in cache (one thread, thread CPU time:
  // N = 1000, K = 100k, D = 1 474-550 us; N = 100, K = 10k 37 us; N = 1000, K = 50k, D = 4
  // 223-257 us), where the model, fitted on a grid whose planned shapes had their sources out of
  // cache, took it for 0.5 ns and picked it over a direct walk 3-4x faster (124-141 us at the
  // first shape). 3 ns leaves every pick of the calibration grid as it was (radix at N = 1M,
  // K = 10k, D = 1 bfloat16, 117 us, would turn to direct, 250 us, from 4 ns).
  static constexpr double kNsPerCachedSourceRow = 3.0;
  // The working set that counts as cached.
  static constexpr double kCacheBytes = 838e3;
  // Sparse scratch: per row of N (two bitmaps and their ranks).
  static constexpr double kBitmapNsPerRow = 0.116;
  // Plan building. Counting sort: per row of N and per entry. Radix sort: digits of at most
  // kRadixDigitBits bits; per entry and pass, per bucket and pass.
  static constexpr double kCountNsPerRow = 3.09;
  static constexpr double kCountNsPerEntry = 0.51;
  // (Intel Xeon with AMX, C++, the radix plan alone, medians of 21, three runs: at most 8 and 11
  // bits within each other's noise, N = 100k K = 1M 10.2-12.8 / 10.0-13.3 ms, N = K = 1M
  // 14.3-17.1 / 14.3-20.8 ms, N = 16M K = 1M 16.5-20.4 / 16.0-18.7 ms, but 11 ahead at
  // N = 262144 K = 4096, 30-38 / 35-45 us; at most 13 or 16 bits lost from N = 1M: N = 16M K = 1M
  // 21.9-25.6 ms.)
  static constexpr int kRadixDigitBits = 11;
  static constexpr double kRadixNsPerEntryPass = 2.49;
  static constexpr double kRadixNsPerBucket = 0.318;
  // The part of a planned call that runs on one thread whatever the thread count: the sort, timed
  // apart (`bench_scatter_add --strategies`): counting sort 4 to 14 ns per entry (N = 4096,
  // K = 65536: 262 us; N = 32768, K = 65536: 467 us; N = 100k, K = 1M: 13.8 ms), radix 10 to 12 ns
  // (N = 262144, K = 4096: 43 us; N = 1M, K = 100k: 1.2 ms; N = 100k, K = 1M: 11.7 ms). The
  // one-thread fit above spreads that cost over its other terms, so its sort terms alone
  // understate it. Those were a Xeon's. On a Zen 5 EPYC (the same tool, 2 threads) the counting
  // sort took 0.9 to 1.7 ns an entry where its arrays (16 bytes an entry, 8 a row) stay in the
  // L2 or near it: N = 4096 K = 65536 57 us, N = 32768 K = 65536 110 us, N = 8192 K = 16384 23 us;
  // 2.7 to 5 ns at N = 100k K = 1M. At 10 ns throughout, two threads took the direct walk at
  // K = 65536 D = 64 bf16 where the plan was 2x faster. So arrays of at most
  // kSerialSortCachedBytes count kSerialSortCachedNsPerEntry. The sweep's cells whose pick that
  // changes, each strategy forced in a sweep of its own, direct -> count: bf16 D = 64 K = 65536
  // N = 6554 uniform 439 -> 235 us, zipf 589 -> 223 us, N = 32768 top-2 902 -> 404 us, N = 8192
  // top-8 455 -> 249 us; D = 128 K = 32768 N = 33 / 328 150 -> 96 / 225 -> 137 us; float32
  // D = 32 N = 13107 K = 131072 711 -> 729 us; all entries in one row, N = 6554 K = 65536 D = 64
  // bf16, 142 -> 186 us (torch's best 487 us).
  static constexpr double kSerialSortNsPerEntry = 10.0;
  static constexpr double kSerialSortCachedNsPerEntry = 3.0;
  static constexpr int64_t kSerialSortCachedBytes = 4 << 20;

  // Direct with several threads: split columns when each thread gets at least this many bytes
  // of every row (whole cache lines, and a balanced split whatever the index), rows otherwise.
  // Every thread walks the whole index, so a share must outweigh that: at 128 B per thread
  // (N = 33, K = 32768, D = 128 on two threads) the split took 1.4-3.5x one thread's time; at
  // 2 KB and more (D >= 512 float32) two threads took 0.55-0.7x of it.
  static constexpr int64_t kMinColumnShareBytes = 512;
  // The cost model counts a column split as dividing the walk only from this share on: two
  // threads, wall time, D = 1024 float32 (2 KB shares) N = 41 / 4096, K = 4096: 1.3x / 1.7x
  // faster than one; D = 256 float32 (512 B shares) N = 164, K = 16384: 0.65x to 1x.
  static constexpr int64_t kColumnShareScalesBytes = 2048;
  // Rows wide enough for a column split take ranges of rows instead (every thread walks the whole
  // index and skips the others' entries, cheap beside a row's work) when a sample of the index
  // gives no thread more than Num / Den of an equal share of the entries; a hot row that
  // unbalances the ranges keeps the column split. On the 2-vCPU EPYC (no AVX-512), two cores
  // adding into float32 rows near each other's were slower than one: a C loop of row adds, K = N = 256, D = 1024, two
  // threads against one, columns of every row 3.1x slower, alternate rows 1.8x slower, blocks of
  // 4 rows (16 KiB) even, of 16 rows 1.5x faster, halves of the rows 1.8x faster. Through the
  // Python API, two threads, medians, uniform index, columns -> ranges of rows (index_add_):
  // float32 N = K = 64 D = 4096 63.3 -> 27.7 us (39.5), N = K = 256 D = 1024 121 -> 24.3 us (58.3),
  // N = K = 1024 D = 256 151 -> 30.0 us (76.0); sorted N = 64 K = 4096 D = 1024 234 -> 183 us
  // (236). Memory-bound shapes (out of 80 MB and more) and bf16 (summed in a scratch) were even.
  static constexpr int64_t kRowsBalanceNum = 5;
  static constexpr int64_t kRowsBalanceDen = 4;
  // The cost model counts these ranges as dividing float32/float64 walks whose out has at most
  // kRangesDivideMaxOutBytes (choose.cpp, threaded_ns); it had priced them as undivided below
  // kColumnShareScalesBytes and picked a planned walk halved over two threads. On the 2-vCPU EPYC
  // (no AVX-512), two threads, each strategy forced, through the Python API, the sweep's timing
  // interleaved with torch's (bench_sweep.run_cell), speedup over index_add_ in the same cell,
  // two runs, direct against count, with the hot-row prefetch of row_kernels.h
  // (add_row_buffered): float32 D = 256 N = 16 K = 16384 1.27-1.39x against 1.14-1.20x; N = 4
  // K = 65536 1.43-1.48x against 1.11-1.14x; N = 256 K = 65536 (out 256 KiB) 1.91-1.94x against
  // 1.61-1.64x; N = 64 K = 4096 1.18-1.25x against 1.07-1.18x; N = 164 K = 16384 1.34-1.38x
  // against 1.32-1.47x; float64 D = 128 N = 164 K = 16384 1.26-1.36x against 1.09-1.11x (before
  // that prefetch, count at N = 16 / 164 took 0.99-1.07x / 1.05-1.09x). A larger out lost: N = 256
  // K = 4096 D = 512 (512 KiB) 0.94-1.00x against 1.05-1.12x; with out in memory a loop of one
  // strategy's calls and the interleaved timing disagree (N = K = 4096 D = 256 163-181 us against
  // count 191-251 in a loop, 0.95-0.98x against 1.12-1.19x interleaved; N = K = 16384 and 65536
  // 1.21-1.27x against 1.23-1.34x interleaved), so there the former pricing stays. bf16 rows,
  // whose cut falls on 64-row blocks, were mixed or slower (N = 4 K = 16384 D = 512 736-886 us
  // against count 581-628; N = 16384 K = 1024 D = 512 104-111 against radix 84-96) and are not
  // counted.
  static constexpr int64_t kRangesDivideMaxOutBytes = 256 << 10;
  // On two threads they are counted as dividing whatever the size of out where the index names a
  // row at most 1 / kRangesDivideSparseLoadDen times on average (K <= N / Den): each thread then
  // adds few entries into rows of its own (its rows cut by their entries alone, cut_rows), where a
  // plan pays its sort and reads every source row at random. More threads keep the former pricing:
  // not measured.
  // The recorded two-thread grids (`bench_scatter_add --evaluate
  // benchmarks/cpu_calibration_{xeon_480m,zen5}_2t.csv`, least wall time of each strategy forced)
  // had one such shape of 1 KiB rows, float32 N = 16384 K = 1638 D = 256 (out 16 MiB): direct
  // 33.1 / 20.7 us (uniform / zipf) against radix's 47.0 / 33.0 on the Xeon with AMX, 20.1 / 15.9
  // against 24.7 / 21.3 on the Zen 5 EPYC, where the model had picked radix; no other pick of either
  // grid changes (regret 1.034x -> 1.028x and 1.040x -> 1.036x). Through the Python API on that
  // Xeon, two threads, the sweep's timing (bench_sweep.run_cell), two processes each, ours' us
  // radix (the old pick) -> direct, torch's best beside: float32 D = 256 N = 16384 K = 1638
  // 82-86 -> 55-58 (89-105), N = 32768 K = 4096 270-280 -> 193-196 (322-333), N = 65536 K = 6554
  // 435-439 -> 332-339 (515-558), N = 1M K = 100k 13.0-13.4 -> 7.9-8.7 ms (12.6-13.9), zipf
  // N = 100k K = 10k 471-506 -> 374-375 (622-636); D = 512 N = 16384 K = 2048 234-240 -> 179-191
  // (258-278); float64 D = 128 N = 65536 K = 6554 442-453 -> 334-419 (523-600). Where rows are
  // named about once (N = K = 16384, D = 256) the two CPUs disagree (direct 1.15x faster than
  // count on the Xeon, 1.41x slower on the Zen 5), so there the former pricing stays.
  static constexpr int64_t kRangesDivideSparseLoadDen = 8;
  // Direct, rows too narrow for that: a row split costs each thread this much per mispredicted
  // skip of another thread's entry. Measured with 1 and 2 threads (wall time, idle 2-core Xeon),
  // where every thread walks the whole index: N = 100k, K = 1M, D = 1 float32 took 2.3-2.4 ms on
  // one thread and 7.8-8.7 ms on two (about 5.5 ns more per entry, half of them mispredicted);
  // N = 10k, K = 10k, D = 8 float32 36-57 us and 94-96 us.
  static constexpr double kRowSplitSkipNs = 11.0;
  // A row split that does not deal its entries has every thread read the whole index (twice where
  // it compacts them) and, unless it compacts, stream every source row. Where the index names each
  // row more than kRowSplitMaxLoad times on average, the rows' work it divides is small beside
  // that; where it names fewer than kRowSplitMinLoad (a split other than a dealt one or a
  // float32/float64 compacted one), the call is mostly its passes over out. Zen 5 EPYC, two
  // threads, `bench_scatter_add --threads 2 --calibrate` (140 shapes, least wall time of each
  // strategy forced), the direct walk on two threads against one thread's CPU time: K / N = 10,
  // float32 D = 64 1.25-1.92x the time, bf16 D = 64 2.25-2.31x, bf16 D = 256 1.37-1.49x; K / N = 1
  // 0.54-1.02x (float32 D = 64 zipf 1.54x);
  // 0.1 0.57-0.97x; 0.01 1.04-1.43x (calls of 4 to 90 us). The one-thread times are
  // benchmarks/cpu_calibration_zen5.csv. The regret of the grid's two-thread picks: 1.070-1.072x
  // in three runs before, 1.034-1.040x after (with kCompactWideMinOutBytes; a run after is
  // benchmarks/cpu_calibration_zen5_2t.csv, for --evaluate); worst 2.66-2.71x (float32 D = 64
  // N = 6553 K = 65536 zipf, the direct walk split where the plan took 0.38x its time) before,
  // 1.70-1.82x after (N = 655 K = 65536, N = 26214 K = 262144, where the plan on two threads beats
  // the direct walk on one by more than the one-thread model prices). Through the C++ API, two
  // threads, the pick's time, three rounds alternating the builds, least of each: float32 D = 64,
  // N = 16384 (4 MiB out), K / N = 1.5 to 8: 0.46-0.87x of the time before; N = 4096 to 114688,
  // K = 8 N: 0.47-0.79x; bf16 D = 64 K = 8 N, N = 65536 and 196608, 0.48-0.83x (N = 8192, a plan
  // either way, 1.00x); rows of 16 and 32 float32 columns 0.92-1.09x (and one 1.23x, N = K =
  // 458752 D = 16 zipf, that four more alternated rounds put at 1.01x). Splits that deal (bf16
  // rows of 8 and 32 bytes) still paid at K / N = 3 to 8 (not splitting took 1.09-1.83x the
  // time), so kRowSplitMaxLoad does not apply to them. On an Intel Xeon with AMX (2 vCPUs,
  // 2 MiB L2 each, 480 MiB L3) the same grid, these constants unchanged: 1.011x on one thread,
  // 1.034x on two (benchmarks/cpu_calibration_xeon_480m.csv, _2t.csv), worst 1.59-1.62x at
  // N = 655 K = 65536 again.
  static constexpr double kRowSplitMinLoad = 0.05;
  static constexpr double kRowSplitMaxLoad = 2.0;
  // bf16/fp16 on two threads, rows of at most kDealMaxRowBytes: a row split first deals the
  // entries out to their rows' threads (direct_deals), as copies of at most kDealMaxBytes (kept
  // between calls like the scratch, in a buffer of two positions per entry, of which a call
  // writes one), and then each thread walks only its own; it pays where the
  // walk's estimate per entry, halved, exceeds kDealNsPerEntry. On the 2-vCPU EPYC (no AVX-512),
  // torch 2.13, through the Python API, medians of 15 calls, one thread walking alone -> every
  // thread walking the whole index and skipping the other's entries -> dealt, bf16, uniform
  // unless named: D = 1 N = 1M K = 100k 0.91-0.97 -> 1.01-1.04 -> 0.67-0.69 ms (index_add_
  // 0.85-0.91), zipf 0.70-0.74 -> 0.88 -> 0.65-0.66 ms; N = 300k K = 100k 0.97-0.99 -> 0.73-0.74
  // dealt; N = 4M K = 100k 1.56-1.73 -> 1.41-1.46 -> 0.98-1.18 ms; D = 4 N = 1M K = 100k
  // 1.69-1.83 -> 1.55 -> 1.07-1.26 ms. Dealing itself took about 2 ns per entry of wall time
  // (K = 1M: counting 0.36 ms, copies 1.63 ms). It lost where the estimate per entry is 4.5 to 6.5
  // ns (N = K = 1M D = 1 zipf 3.3 -> 4.7 ms); at 8.7 to 8.8 ns it went either way (N = K = 1M
  // D = 4 14.8-15.7 -> 9.5-9.8 ms, N = 52429 K = 524288 D = 8 2.63-2.77 -> 2.80-2.85 ms, N = 100k
  // K = 1M D = 8 zipf 4.7-5.7 ms both ways); the cells above, at 10.5 to 16.8 ns, and N = K = 1M
  // D = 8 zipf (11.6 ns, 11.4 -> 10.0 ms) won; so 3.5 ns. float32 and float64 deal nowhere:
  // their walk is cheaper per entry than the model says, and dealt splits were slower than one
  // thread at every shape tried (float32 N = 30k K = 20k D = 16 0.092 -> 0.161 ms, float64 N = 200k
  // K = 30k D = 8 0.187 -> 0.277 ms, float32 N = 200k K = 30k D = 16 0.188 -> 0.257 ms).
  // The counting pass has gone since (each half is dealt outward from the middle of each thread's
  // positions, the first half downward), and the deal and the walks share one parallel region: on a
  // Zen 5 EPYC (AVX-512), two builds alternated in one process, 15 rounds of 15-call medians,
  // quartiles of the paired ratios, bf16 N = 1M K = 100k D = 1 uniform 0.87-0.91x of the time, zipf
  // 0.84-0.93x, D = 2 0.83-0.90x, D = 4 0.78-0.91x, N = K = 262144 D = 8 0.86-1.02x; float16 D = 1
  // 0.87-0.96x. Then the AVX-512 levels' deal by compress and masked stores (rows of 2 and 4 bytes),
  // the same way against the build before both changes: D = 1 uniform 0.66-0.69x, zipf 0.67-0.68x,
  // D = 2 0.73-0.75x, float16 D = 1 0.66-0.68x (index_add_ then 1.20-1.34x slower than ours); D = 4
  // 0.88-0.90x. kDealVectorNsPerEntry prices that deal: with every deal allowed, against the build
  // that dealt only above 7 ns an entry (medians of 9 paired rounds, quartiles; the walk's estimate
  // per entry in brackets), bf16 D = 1: N = K = 1M (6.5 ns) 0.79-0.80x uniform, 0.82-0.85x zipf;
  // N = 200k / 150k K = 1M (3.8 / 3.2 ns) 0.80-0.82x; N = 150k K = 100k (3.9 ns) 0.51-0.76x;
  // N = K = 100k (3.0 ns) 0.80-0.89x uniform, 0.98-1.05x zipf; D = 2 N = 100k K = 1M (3.9 ns)
  // 0.63-0.71x, N = K = 100k (4.6 ns) 0.59-0.64x. Below 3 ns it went both ways: 0.79-0.90x at
  // N = 100k K = 300k (2.8 ns), N = K = 65536 (2.7 ns), N = 50k K = 100k (2.3 ns) and D = 2 N = 30k
  // K = 100k (2.6 ns); but 1.06-1.16x at N = 100k K = 1M (2.7 ns, uniform and zipf) and 1.01-1.18x
  // at N = 10k K = 1M (1.7 ns). So dealt above 3 ns: against the build before, N = K = 1M
  // 0.81-0.87x, D = 2 N = 100k K = 1M 0.59-0.62x, float16 N = 200k K = 1M 0.63-0.69x, N = 100k
  // K = 1M and N = K = 524288 D = 2 (dealt before) 0.96-1.04x.
  static constexpr int64_t kDealMaxRowBytes = 64;
  static constexpr int64_t kDealMaxBytes = 32 << 20;
  static constexpr double kDealNsPerEntry = 3.5;
  static constexpr double kDealVectorNsPerEntry = 1.5;
  // Row split, float32/float64 rows (and bf16/fp16 rows added in place) of kCompactMinRowBytes to
  // kCompactMaxRowBytes into an out of kCompactMinOutBytes or more: each thread compacts each
  // block of entries to its own before it adds them, their rows prefetched whole (DirectJob::compact,
  // row_kernels.h), where the walk skipped the other's entries one by one. Zen 5 EPYC, 2 threads,
  // the C++ API, two builds run in turn (ABBA, 4 rounds of 9-call medians), time compacted / before:
  // float32 D = 64 N = K = 262144 uniform 0.80x, zipf 0.69x, N = 1M K = 100k 0.70x; D = 128
  // N = K = 131072 0.77x, N = K = 100k zipf 0.61x; float64 D = 32 N = K = 262144 0.74x. Not
  // compacted: rows of 1 KiB (float32 D = 256 N = K = 65536, 1.02x) and outs the caches hold
  // (D = 64: N = 4096 K = 65536, a 1 MiB out, 1.8x; N = 30000 K = 20000 1.09x; N = 20000 K = 6000
  // 0.99x).
  static constexpr int64_t kCompactMinRowBytes = 64;
  static constexpr int64_t kCompactMaxRowBytes = 512;
  static constexpr int64_t kCompactMinOutBytes = 32 << 20;
  // Rows of kCompactWideRowBytes or more compact from an out of kCompactWideMinOutBytes, which
  // the caches may hold: Zen 5 EPYC, two threads, the C++ API, the pick's time, builds
  // alternated (three rounds, least of each), against the split that skips the other's entries one
  // by one, K = N: float32 D = 64 N = 4096 0.74-0.75x, 16384 0.87-0.94x, 65536 0.74-0.81x, 114688
  // 0.78-0.83x; D = 128 N = 2048 0.56-0.65x, 8192 0.84-0.89x, 32768 0.67-0.73x, 57344 0.68-0.76x.
  // Narrower rows into such outs were mixed (float32 D = 32 N = 131072 K = 8 N 1.6x slower, D = 16
  // N = 65536 K = 8 N 1.4x slower; K = N 0.46-1.28x), so they keep kCompactMinOutBytes.
  static constexpr int64_t kCompactWideRowBytes = 256;
  static constexpr int64_t kCompactWideMinOutBytes = 1 << 20;
  // What compacting costs a thread per entry (a second read of the index, a store per entry):
  // direct_row_split_pays weighs it against the walk it divides, so rows of 64 and 128 bytes, which
  // one thread walked alone on two threads, split too. Zen 5 EPYC, two builds ABBA (two sets of 3
  // rounds, 9-call medians), time after / before: float32 D = 16 N = K = 1M 0.49x / 0.78x, zipf
  // 0.67x / 0.92x, N = 2M K = 200k 0.51x / 0.85x; D = 32 N = K = 524288 0.56x / 0.71x, N = K =
  // 262144 0.57x / 0.79x, N = 524288 K = 100k 0.53x / 0.71x, every entry in one row 0.92x / 0.79x;
  // float64 D = 16 N = K = 262144 0.60x / 0.82x.
  static constexpr double kCompactNsPerEntry = 1.0;
  // The direct walk prefetches destination rows ahead only when out is larger than this (a
  // cache-resident out gains nothing and the prefetch costs a third of a D = 1 walk). Intel Xeon
  // with AMX (2 MiB L2), C++, float32 D = 1, K = 1M uniform, one thread, three runs alternated,
  // without -> with the prefetch: out of 256 KiB 1.71-2.00 -> 2.15-2.30 ms, 1 MiB 2.31-2.72 ->
  // 2.35-2.52 ms, 4 MiB 3.30-4.00 -> 2.35-3.40 ms, 16 MiB 4.75-6.47 -> 4.37-6.04 ms.
  static constexpr int64_t kPrefetchAboveBytes = 1 << 20;
  // A plan walk that moves this many bytes or more (its source rows and destination rows; the L3
  // of the machines measured holds 32 MiB) prefetches source rows of up to 2 KiB whole, where one
  // that the caches hold streams them (row_kernels.h, kFarNearRowBytes: the rows measured there
  // moved 16 MiB or less and 96 MiB or more).
  static constexpr int64_t kFarWalkBytes = 32 << 20;
  // Row split: a sample of kBalanceSamples index entries is counted per block of 2^shift rows
  // (at most kMaxBlocks blocks) to cut the rows into shares of equal work. Bounds, not tuned
  // speeds: the sample's counts fit in 32 KiB, and 16384 entries give each of two shares its
  // work within about 1% (one standard deviation of a share's count, 64 of 8192).
  static constexpr int64_t kMaxBlocks = 4096;
  static constexpr int64_t kBalanceSamples = 16384;
  // Sorted index, one column at a time: runs are summed run by run (a branch per run, about two
  // mispredicted branches a run) when kRunSamples sampled neighbour pairs give a mean run length of
  // at least kLongRun*; shorter runs take a walk with no branch per run. That walk costs more for
  // bf16/fp16 (a dependent chain per entry, or for one contiguous column on AVX-512 one pass per
  // entry of a 16-entry block's longest run) than for float32/float64 (each entry a read-modify-
  // write of its row, no chain across rows). Xeon with AMX, C++, one column, K = 1M sorted, random
  // run lengths of mean L, time run by run / without a branch per run (medians of 7 alternated
  // rounds of 11 calls, one thread unless said): float32 AVX-512 L = 12 1.04-1.10x, 14 1.01x,
  // 16 0.86-0.87x (two threads 1.08x, 0.97x, 0.88x; AVX2 and scalar L = 12 1.08x, 16 0.90x), so
  // 14; bf16 AVX-512 L = 4 1.16-1.19x, 5 0.98-1.02x, 6 0.83-0.84x (two threads L = 5 1.05x,
  // 6 0.94x; AVX2 L = 3 0.99x, 4 0.83x; scalar 3 0.94x), fp16 AVX-512 L = 4 1.22-1.23x,
  // 5 0.88-0.90x, 6 0.76x (two threads L = 5 1.04x, 6 0.93x; AVX2 L = 3 0.96x; scalar 2 0.69x),
  // so 5 for both.
  // 256 neighbour pairs are at most 256 cache misses, and tell the thresholds' runs apart: runs of
  // mean 5 end at about 51 of them, runs of mean 14 at about 18 (Poisson spreads of 7 and 4).
  static constexpr int64_t kRunSamples = 256;
  static constexpr int64_t kLongRunExact = 14;    // float32, float64
  static constexpr int64_t kLongRunRounded = 5;   // bf16, fp16
};

}  // namespace cpu
}  // namespace scatter_add
