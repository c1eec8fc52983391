/* The TCP transport's frame header: what crosses the wire before each payload. */
#pragma once
#include <stdint.h>

#define MK_FRAME_MAGIC 0x31464b4du /* "MKF1" */
#define MK_FRAME_PAYLOAD_MAX (512u << 10) /* a WRITE is cut into frames of at most this */

enum { MK_FRAME_DATA = 1, MK_FRAME_SIGNAL = 2, MK_FRAME_FLUSH = 3, MK_FRAME_FLUSH_ACK = 4, MK_FRAME_BYE = 5 };

typedef struct mk_frame {
  uint32_t magic;
  uint8_t type; /* MK_FRAME_* */
  uint8_t flag_op; /* MK_FLAG_*: applied once the whole write has arrived */
  uint8_t dst_region;
  uint8_t pad; /* zero */
  uint32_t bytes; /* payload following this header */
  uint32_t write_bytes; /* DATA: the whole write's size; the frames of one write may arrive in any order */
  uint32_t id; /* DATA: the write's id; FLUSH, FLUSH_ACK: the flush's id */
  uint32_t flag_id;
  uint32_t flag_value;
  uint32_t pad2; /* zero */
  uint64_t dst_offset; /* DATA: where this frame's payload goes */
} mk_frame;

_Static_assert(sizeof(mk_frame) == 40, "mk_frame is 40 bytes on the wire");
