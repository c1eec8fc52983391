#pragma once
// The command queue between GPU producers and the host proxy: one definition, read by the device
// producer (queue.cuh, through NVRTC) and by the C proxy (mkernel/verbs, through gcc). Plain
// fixed-width fields and macros only: no device code, no system headers.
//
// Protocol (docs/TRANSPORT.md has the full story):
//   producer: ticket t = reserve++ (a counter in device memory, or in host memory for CPU producers)
//             wait until t < tail + capacity                    (acquire load of tail; GPU producers
//                                                                check a device-memory copy first)
//             write words 1..7 of slot t % capacity
//             store seq = (u32)t + 1                            (system-scope release, last)
//   proxy:    at head h, wait until slot.seq == (u32)h + 1      (acquire load)
//             copy the command out, h++, then publish tail = h  (release store)
// capacity is a power of two below 2^31, so a seq left over from an earlier lap never matches.

#define MK_CMD_BYTES 32

// Command types.
#define MK_CMD_WRITE \
  1  // bytes from local (src_region, src_offset) to the peer's (dst_region, dst_offset), then its flag
#define MK_CMD_SIGNAL 2  // the peer's flag flag_id: set to or add flag_value (flag_op); unordered with earlier WRITEs
#define MK_CMD_FLUSH \
  3  // once every earlier command to `peer` is applied there, this rank's own flag_id gets flag_value
#define MK_CMD_NOP 4  // consumed and counted, nothing sent (the null transport's stress and benchmark commands)

// What a WRITE or SIGNAL does to its flag.
#define MK_FLAG_NONE 0
#define MK_FLAG_SET 1  // release-store flag_value (an epoch)
#define MK_FLAG_ADD 2  // atomically add flag_value (a counter)

// Offsets are 48-bit (256 TiB): 16 high bits and 32 low bits, so the command stays 32 bytes.
#define MK_OFFSET_MAX ((1ULL << 48) - 1)
#define MK_CMD_OFFSET(hi, lo) (((unsigned long long)(hi) << 32) | (unsigned long long)(lo))
#define MK_OFFSET_HI(off) ((unsigned short)((unsigned long long)(off) >> 32))
#define MK_OFFSET_LO(off) ((unsigned int)((unsigned long long)(off) & 0xffffffffULL))

struct MkCmd {
  unsigned int seq;  //  0: (u32)ticket + 1; written last, with release
  unsigned char type;  //  4: MK_CMD_*
  unsigned char flag_op;  //  5: MK_FLAG_*
  unsigned short peer;  //  6: destination rank
  unsigned int bytes;  //  8: WRITE payload size
  unsigned int flag_value;  // 12: epoch (SET) or increment (ADD)
  unsigned short flag_id;  // 16: index into the flag array of the peer (WRITE, SIGNAL) or of this rank (FLUSH)
  unsigned char src_region;  // 18: registered region ids
  unsigned char dst_region;  // 19
  unsigned short src_off_hi;  // 20
  unsigned short dst_off_hi;  // 22
  unsigned int src_off_lo;  // 24
  unsigned int dst_off_lo;  // 28
};

// Host memory, mapped into the GPU. Producer-owned and proxy-owned words sit on separate lines.
struct MkQueueHeader {
  unsigned long long tail;  // proxy: commands consumed; slots below tail + capacity are free
  unsigned int error;  // proxy: MK_ERR_* once it failed (0: running); GPU waits give up on it
  unsigned int capacity;  // slots (power of two)
  unsigned int pad0[12];
  unsigned long long reserve;  // CPU producers' ticket counter (GPU producers use a device counter)
  unsigned int pad1[14];
};

// The producer's view, passed inside a kernel's argument struct. One proxy and queue serve every
// communicator of a process: a sub-communicator's commands name its own ranks, workspace offsets
// and flag ids, and the producer translates them into the proxy's (queue.cuh, queue_translate).
struct MkQueue {
  struct MkQueueHeader* header;  // mapped host memory
  struct MkCmd* slots;  // mapped host memory, capacity slots
  unsigned long long* reserve;  // device memory, 2 words: the ticket counter (GPU atomics on host memory
      // are not native), then the highest tail a producer has read (a cache)
  const unsigned short* ranks;  // device memory: the communicator's rank -> the proxy's (NULL: the same)
  unsigned long long workspace_base;  // added to offsets in MK_WORKSPACE_REGION: where the communicator's
      // workspace lies in the proxy's
  unsigned int mask;  // capacity - 1
  unsigned int flag_base;  // added to flag ids: the communicator's range of the proxy's flag array
  const unsigned int* flags;  // mapped host memory: the proxy's flag array (what its commands set)
  unsigned int* relay;  // device memory, 2 words per flag: the last value one waiter read from the host
      // flag, then 1 while a waiter polls it (queue.cuh, wait_remote): one GPU poller per flag on PCIe
};

// The region every communicator's proxy registers its root workspace as (comm.PROXY_WORKSPACE_REGION).
#define MK_WORKSPACE_REGION 0
