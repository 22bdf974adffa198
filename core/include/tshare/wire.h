/* tshare/wire.h - the versioned wire format, as a sans-IO encoder and decoder.
 *
 * Every frame is a 12-byte header followed by a payload, all little-endian:
 *
 *   offset size field
 *   0      4    magic "TSHR" (0x54 0x53 0x48 0x52)
 *   4      1    major version
 *   5      1    minor version
 *   6      1    frame type (TSHARE_FRAME_*)
 *   7      1    flags (TSHARE_FRAME_FLAG_*)
 *   8      4    payload length in bytes
 *
 * Versioning rule. The major version changes when an existing field changes
 * meaning, size or position; a reader rejects any other major with
 * TSHARE_E_VERSION before it reads anything else, and may only report the error.
 * The minor version grows when fields are appended to the end of a payload or a
 * frame type is added. A reader accepts a newer minor: it reads the fields it
 * knows and ignores trailing payload bytes. Both ends send their minor in the
 * hello and afterwards send nothing newer than the smaller of the two, so a frame
 * type a reader does not know (TSHARE_E_UNKNOWN_TYPE) is always a peer's bug.
 *
 * The decoder does no I/O (like hiredis' reader): feed it bytes, take frames.
 * Every length and count is checked against a named limit before it is used,
 * and a share's layout is checked to stay inside its allocation. After any
 * error the decoder stays failed: framing is lost, the stream must be closed.
 */
#ifndef TSHARE_WIRE_H
#define TSHARE_WIRE_H

#include "tshare/tensor.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TSHARE_WIRE_MAGIC_0 0x54 /* 'T' */
#define TSHARE_WIRE_MAGIC_1 0x53 /* 'S' */
#define TSHARE_WIRE_MAGIC_2 0x48 /* 'H' */
#define TSHARE_WIRE_MAGIC_3 0x52 /* 'R' */
#define TSHARE_WIRE_MAJOR 1
#define TSHARE_WIRE_MINOR                                                                                              \
  6 /* 1: event and retire frames; origin_pid and share_flags appended to share; 2: ring frames; 3: tensor sets;      \
       4: kept host mappings (TSHARE_MEM_HOST_KEPT, the retire frame's mem_kind); 5: remote memory over UCX          \
       (TSHARE_MEM_UCX_REMOTE, the rkey frame) and kept host mappings in tensor sets (share_flags appended to a     \
       host set memory, TSHARE_CAP_SET_HOST_KEPT); 6: remote memory in tensor sets (set memories of                  \
       TSHARE_MEM_UCX_REMOTE, TSHARE_CAP_UCX_SETS) and a set sent again as one frame (the begin frame's           \
       layout_slot, TSHARE_SET_AGAIN, TSHARE_SET_DROPPED, TSHARE_CAP_SET_AGAIN) */
#define TSHARE_WIRE_HEADER_SIZE 12

/* Hard maxima of the frame structs below; tshare_wire_limits can only lower them. */
#define TSHARE_HANDLE_MAX 64      /* bytes of an inline memory handle (a CUDA IPC handle is 64) */
#define TSHARE_TAG_MAX 64         /* bytes of a share's tag, not counting the NUL kept after it */
#define TSHARE_ERROR_TEXT_MAX 200 /* bytes of an error frame's message */
#define TSHARE_RELEASE_MAX 256    /* share ids in one release frame */
#define TSHARE_HELLO_DEVICES_MAX 16
#define TSHARE_HELLO_NAME_MAX 32

typedef enum tshare_frame_type {
  TSHARE_FRAME_HELLO = 1,
  TSHARE_FRAME_SHARE = 2,
  TSHARE_FRAME_RELEASE = 3,
  TSHARE_FRAME_BYE = 4,
  TSHARE_FRAME_ERROR = 5,
  TSHARE_FRAME_EVENT = 6, /* minor 1: an inter-process CUDA event for a slot of the sender's pool */
  TSHARE_FRAME_RETIRE = 7, /* minor 1: allocations going away (closed = 0), closed by the receiver (closed = 1), or
                              kept mapped by it until retired (closed = 2, TSHARE_CAP_CUDA_HELD) */
  TSHARE_FRAME_RING = 8,   /* minor 2: the ring transport's own frames (never seen above the connection) */
  TSHARE_FRAME_CHUNK = 9,  /* minor 2: one more chunk of the VMM memory of the share that follows, its fd attached */
  TSHARE_FRAME_SET = 10,   /* minor 3: one step of a tensor set (tshare_set_op), sent only to a peer with
                              TSHARE_CAP_TENSOR_SETS */
  TSHARE_FRAME_RKEY = 11   /* minor 5: where the TSHARE_MEM_UCX_REMOTE allocation named by the shares that follow
                              lies in the sender's memory, and the packed UCX remote key that reads it */
} tshare_frame_type;

/* Header flags. */
#define TSHARE_FRAME_FLAG_FD_ATTACHED (1u << 0) /* one fd travels beside this frame (SCM_RIGHTS) */
#define TSHARE_FRAME_FLAG_HAS_EVENT (1u << 1)   /* share: event_slot/event_generation are meaningful */
#define TSHARE_FRAME_FLAGS_KNOWN (TSHARE_FRAME_FLAG_FD_ATTACHED | TSHARE_FRAME_FLAG_HAS_EVENT)

/* Hello capabilities. */
#define TSHARE_CAP_FD_PASSING (1u << 0) /* the channel can carry fds */
#define TSHARE_CAP_HOST_MEMFD (1u << 1) /* can import host memfd shares */
#define TSHARE_CAP_CUDA_IPC (1u << 2)   /* can import legacy CUDA IPC shares */
#define TSHARE_CAP_CUDA_FD (1u << 3)    /* can import CUDA VMM shares whose memory travels as an fd */
#define TSHARE_CAP_RING (1u << 4)       /* wants the shared-memory ring transport (sockets only) */
#define TSHARE_CAP_CUDA_HELD                                                                                           \
  (1u << 5) /* keeps VMM mappings it announces with a retire frame (closed = 2) until their owner retires them, and    \
               takes TSHARE_MEM_CUDA_HELD shares of them */

#define TSHARE_CAP_TENSOR_SETS (1u << 6) /* minor 3: receives tensor sets (TSHARE_FRAME_SET) */
#define TSHARE_CAP_HOST_KEPT                                                                                           \
  (1u << 7) /* minor 4: may keep host memfd mappings of shares sent with TSHARE_SHARE_FLAG_RETIRE_NOTICE, says so in  \
               a retire frame (closed = 2, mem_kind TSHARE_MEM_HOST_MEMFD) and takes TSHARE_MEM_HOST_KEPT shares of    \
               them until their owner retires them */
#define TSHARE_CAP_SET_CUDA                                                                                            \
  (1u << 8) /* minor 3: receives CUDA memories in tensor sets (set MEM frames of TSHARE_MEM_CUDA_IPC or _FD with      \
               their share_flags, chunk frames before them, the END frame's event) */
#define TSHARE_CAP_HOST_FD                                                                                             \
  (1u << 9) /* takes TSHARE_MEM_HOST_FD shares: host memory in an unsealed regular file (a tmpfs or /dev/shm file, \
               as torch's shared CPU memory), accepted from a peer of its own uid only */
#define TSHARE_CAP_UCX_REMOTE                                                                                          \
  (1u << 10) /* minor 5: takes TSHARE_MEM_UCX_REMOTE shares (an rkey frame first) and reads them with UCX */
#define TSHARE_CAP_SET_HOST_KEPT                                                                                       \
  (1u << 11) /* minor 5, with TSHARE_CAP_HOST_KEPT: keeps host memfds of tensor sets as it keeps those of shares:     \
                takes a host set memory with share_flags (TSHARE_SHARE_FLAG_RETIRE_NOTICE) and set memories of kind   \
                TSHARE_MEM_HOST_KEPT (no fd) */
#define TSHARE_CAP_SET_AGAIN                                                                                           \
  (1u << 12) /* minor 6: keeps the layout of sets it received, so a set sent again travels as one frame (the begin   \
                frame's layout_slot, TSHARE_SET_AGAIN), and says which it lost (TSHARE_SET_DROPPED) */
#define TSHARE_CAP_UCX_SETS                                                                                            \
  (1u << 13) /* minor 6, with TSHARE_CAP_UCX_REMOTE and TSHARE_CAP_TENSOR_SETS: takes set memories of kind            \
                TSHARE_MEM_UCX_REMOTE (each after the rkey frame of its allocation) and reads them with UCX */
#define TSHARE_CAP_UCX_STAGED                                                                                          \
  (1u << 14) /* minor 6, with TSHARE_CAP_UCX_REMOTE: takes TSHARE_MEM_UCX_REMOTE shares and set memories whose         \
                device_type is TSHARE_DEVICE_CUDA: GPU bytes the sender staged in host memory, which the receiver    \
                reads and places on a GPU of its own */

/* Share flags (share_flags, minor 1). Unknown bits are ignored. */
#define TSHARE_SHARE_FLAG_RETIRE_NOTICE                                                                                \
  (1u << 0) /* the sender announces with a retire frame before it frees the                                            \
               allocation, so the receiver may keep it mapped while idle */
#define TSHARE_SHARE_FLAG_CHUNKS                                                                                       \
  (1u << 1) /* minor 2, TSHARE_MEM_CUDA_FD: the attached fd is the first of several chunks mapped side by side;        \
               the others came just before, in chunk frames of this alloc_id */
#define TSHARE_SHARE_FLAG_HOLD_OFFER                                                                                   \
  (1u << 2) /* TSHARE_MEM_CUDA_FD, to a peer with TSHARE_CAP_CUDA_HELD: the receiver may keep this allocation mapped \
               until it is retired and say so (retire frame, closed = 2); its next shares then come as               \
               TSHARE_MEM_CUDA_HELD */

/* Memory kinds of a share. */
typedef enum tshare_mem_kind {
  TSHARE_MEM_HOST_MEMFD = 1, /* a sealed memfd; the fd is attached to the frame */
  TSHARE_MEM_CUDA_IPC = 2,   /* a cudaIpcMemHandle_t in handle[] */
  TSHARE_MEM_CUDA_FD = 3,    /* a CUDA VMM POSIX-fd handle; the fd is attached */
  TSHARE_MEM_CUDA_HELD = 4,  /* CUDA VMM memory the receiver said it keeps mapped (retire frame, closed = 2): no fd,
                                no handle; alloc_id names it. Sent only to a peer with TSHARE_CAP_CUDA_HELD */
  TSHARE_MEM_HOST_KEPT = 5,  /* minor 4: a host memfd the receiver said it keeps mapped (retire frame, closed = 2,
                                mem_kind 1): no fd; alloc_id names it. Sent only to a peer with TSHARE_CAP_HOST_KEPT */
  TSHARE_MEM_HOST_FD = 6,    /* host memory in an unsealed regular file (not sealed against shrinking); the fd is
                                attached. Sent only to a peer with TSHARE_CAP_HOST_FD, never kept mapped */
  TSHARE_MEM_UCX_REMOTE = 7  /* minor 5: host memory the receiver reads over UCX (ucp_get): no fd, no handle;
                                alloc_id names the region of the last rkey frame for it. Sent only to a peer with
                                TSHARE_CAP_UCX_REMOTE */
} tshare_mem_kind;
#define TSHARE_MEM_KIND_LAST TSHARE_MEM_UCX_REMOTE

typedef struct tshare_hello {
  uint8_t major, minor; /* the sender's own versions (copied from the header) */
  uint32_t pid;
  uint32_t uid;
  uint8_t boot_id[16];                  /* /proc/sys/kernel/random/boot_id */
  uint64_t capabilities;                /* TSHARE_CAP_* */
  char name[TSHARE_HELLO_NAME_MAX + 1]; /* role or program name, NUL-terminated */
  uint32_t device_count;
  uint8_t device_uuids[TSHARE_HELLO_DEVICES_MAX][16];
} tshare_hello;

typedef struct tshare_share_frame {
  uint64_t share_id;   /* unique per sender and channel, never 0 */
  uint64_t alloc_id;   /* identity of the allocation in the sender's process */
  uint8_t mem_kind;    /* tshare_mem_kind */
  uint8_t device_type; /* TSHARE_DEVICE_* */
  uint8_t handle_len;  /* bytes used in handle[] (0 when an fd carries the memory) */
  uint8_t handle[TSHARE_HANDLE_MAX];
  uint8_t device_uuid[16]; /* all zero for host memory */
  uint64_t alloc_size;     /* bytes of the whole allocation */
  uint32_t event_slot;     /* with TSHARE_FRAME_FLAG_HAS_EVENT */
  uint32_t event_generation;
  tshare_tensor_desc tensor;
  uint8_t tag_len;
  char tag[TSHARE_TAG_MAX + 1]; /* NUL-terminated, tag_len bytes */
  /* Appended in minor 1 (0 when a minor-0 peer sent the frame). */
  uint32_t origin_pid;  /* process that owns the allocation (differs from the sender when forwarded) */
  uint32_t share_flags; /* TSHARE_SHARE_FLAG_* */
} tshare_share_frame;

#define TSHARE_EVENT_SLOTS_MAX 1024 /* event slots a sender may announce */

typedef struct tshare_event_frame {
  uint32_t slot;                     /* < TSHARE_EVENT_SLOTS_MAX */
  uint8_t handle[TSHARE_HANDLE_MAX]; /* a cudaIpcEventHandle_t */
} tshare_event_frame;

/* A retire frame's `closed`: what it says of the allocations it names. */
typedef enum tshare_retire_kind {
  TSHARE_RETIRE_FREED = 0,  /* the sender (their owner) will free these: close your mappings and answer CLOSED */
  TSHARE_RETIRE_CLOSED = 1, /* the sender closed its mappings of them */
  TSHARE_RETIRE_KEPT = 2    /* the sender keeps them mapped until they are retired (send them as
                               TSHARE_MEM_CUDA_HELD); minor 1 with TSHARE_CAP_CUDA_HELD */
} tshare_retire_kind;

typedef struct tshare_retire_frame {
  uint8_t closed; /* a tshare_retire_kind */
  uint32_t count; /* 1..TSHARE_RELEASE_MAX */
  uint64_t alloc_ids[TSHARE_RELEASE_MAX];
  /* minor 4, appended: the memory kind of the allocations (TSHARE_MEM_HOST_MEMFD for host memory); 0, and not on
   * the wire, for CUDA memory, the only kind retired before minor 4 */
  uint8_t mem_kind;
} tshare_retire_frame;

/* Ring frames (TSHARE_FRAME_RING), sent only when both hellos had TSHARE_CAP_RING. */
typedef enum tshare_ring_op {
  TSHARE_RING_SETUP = 1,       /* on the socket, after the hellos: the sender's ring, its memfd attached */
  TSHARE_RING_SOCKET_NEXT = 2, /* in the ring: the next frame comes on the socket (it carries an fd) */
  TSHARE_RING_NUDGE = 3        /* on the socket: the ring has bytes for a reader asleep in poll() */
} tshare_ring_op;

typedef struct tshare_ring_frame {
  uint8_t op;        /* tshare_ring_op */
  uint32_t capacity; /* SETUP: data bytes of the ring (a power of two); 0 otherwise */
} tshare_ring_frame;

/* Chunk frames (TSHARE_FRAME_CHUNK): chunk `index` (1..count-1) of the
 * allocation of the share frame that follows; chunk 0 rides on the share. */
#define TSHARE_CHUNKS_MAX 256
typedef struct tshare_chunk_frame {
  uint64_t alloc_id; /* the share's */
  uint32_t index;    /* 1..count-1, in order */
  uint32_t count;    /* 2..TSHARE_CHUNKS_MAX */
  uint64_t size;     /* bytes of this chunk */
} tshare_chunk_frame;

/* Rkey frames (TSHARE_FRAME_RKEY, minor 5): the registered region of a
 * TSHARE_MEM_UCX_REMOTE allocation, sent before the first share of it on a
 * channel (again whenever the region changes). A share's bytes must lie in
 * [0, length) of the region; key is what ucp_rkey_pack gave, opaque here. */
#define TSHARE_RKEY_MAX 1024 /* bytes of a packed remote key (UCX's are tens to a few hundred) */
typedef struct tshare_rkey_frame {
  uint64_t alloc_id; /* the shares' alloc_id */
  uint64_t address;  /* the region's first byte in the sender's address space */
  uint64_t length;   /* bytes of the region, 1..max_alloc_size */
  uint16_t key_len;  /* 1..TSHARE_RKEY_MAX */
  uint8_t key[TSHARE_RKEY_MAX];
} tshare_rkey_frame;

/* Tensor sets (TSHARE_FRAME_SET, minor 3): N named tensors and an opaque
 * metadata blob in one hand-off, released as one unit. A set is a run of set
 * frames with one set_id (taken from the sender's share ids, so one release
 * frame naming it releases the whole set):
 *
 *   BEGIN    count, mem_count, names_bytes, meta_bytes: the totals, checked
 *            against the bounds below before the receiver allocates anything
 *   MEM      mem_count of them, index 0.. in order: one memory the members
 *            point into (a memfd travels once however many members use it)
 *   MEMBER   count of them, index 0.. in order: a name, the index of its
 *            memory and the tensor's layout inside that memory
 *   META     the metadata in order, chunk by chunk (none when meta_bytes is 0)
 *   END      the set is complete
 *
 * or, for a set sent again (minor 6, both ends with TSHARE_CAP_SET_AGAIN):
 *
 *   AGAIN    the layout kept in a slot (the members and their memories of the
 *            set that declared it), then META and END as above
 *
 * A begin frame may ask the receiver to keep the set's layout in slot 1..
 * TSHARE_SET_LAYOUT_SLOTS once the set came whole (replacing the slot's
 * old one), under the set's id as its layout id; the sender offers only sets
 * whose every memory the receiver keeps mapped until retired. An AGAIN the
 * receiver cannot serve (an empty slot, another layout id, a memory retired
 * meanwhile) refuses that set alone.
 *
 * A receiver that lost a layout the sender may still count on tells it with
 * DROPPED (slot and layout id; a frame of its own, never inside a set, sent
 * before the releases of the sets it refused): when it refused an AGAIN it
 * could not serve, refused a set whose BEGIN asked for a slot, or could not
 * keep a layout it was asked to keep. It empties that slot; the sender that
 * still records that layout there sends its builder whole next, and ignores
 * a DROPPED of any other layout (it crossed a newer declaration).
 *
 * The sender sends a set's frames back to back; only the peer's own release,
 * event, retire and DROPPED frames may come between them, and, before a MEM frame of
 * CUDA VMM memory in several chunks, that memory's chunk frames, and, before a
 * MEM frame of remote memory (minor 6), the rkey frame of its allocation. CUDA
 * memories (to a peer with TSHARE_CAP_SET_CUDA only) carry share_flags; the
 * END frame carries the set's one stream-ordering event (HAS_EVENT), recorded
 * once after all members were written. Anything else inside a set,
 * a total that does not add up, a duplicate name or a member outside its
 * memory makes the receiver refuse the set (released back at once). */
#define TSHARE_SET_MEMBERS_MAX 65536u             /* tensors in one set */
#define TSHARE_SET_NAME_MAX 1024u                 /* bytes of one member's name (UTF-8, no NUL) */
#define TSHARE_SET_NAMES_MAX (16u * 1024u * 1024u) /* bytes of all member names of a set together */
#define TSHARE_SET_META_MAX (16u * 1024u * 1024u)  /* bytes of a set's metadata */
#define TSHARE_SET_META_CHUNK_MAX 2032u /* metadata bytes in one META frame: tshare_frame keeps its size */
#define TSHARE_SET_LAYOUT_SLOTS 4u      /* set layouts a receiver keeps per channel (minor 6) */

typedef enum tshare_set_op {
  TSHARE_SET_BEGIN = 1,
  TSHARE_SET_MEM = 2,
  TSHARE_SET_MEMBER = 3,
  TSHARE_SET_META = 4,
  TSHARE_SET_END = 5,
  TSHARE_SET_AGAIN = 6,  /* minor 6, to a peer with TSHARE_CAP_SET_AGAIN */
  TSHARE_SET_DROPPED = 7 /* minor 6, from the receiver of sets to a sender with TSHARE_CAP_SET_AGAIN */
} tshare_set_op;

typedef struct tshare_set_begin_frame {
  uint32_t count;       /* members: 1..TSHARE_SET_MEMBERS_MAX */
  uint32_t mem_count;   /* memories: 1..count */
  uint32_t names_bytes; /* sum of the members' name lengths: count..TSHARE_SET_NAMES_MAX */
  uint32_t meta_bytes;  /* 0..TSHARE_SET_META_MAX */
  /* minor 6, appended only when not 0 (to a peer with TSHARE_CAP_SET_AGAIN): keep this set's layout in slot
   * 1..TSHARE_SET_LAYOUT_SLOTS; 0: keep none */
  uint8_t layout_slot;
} tshare_set_begin_frame;

/* A set sent again (minor 6): the members and memories of the layout kept in
 * layout_slot, which the set layout_id declared; its metadata and end frame
 * follow as a set's do. */
typedef struct tshare_set_again_frame {
  uint8_t layout_slot; /* 1..TSHARE_SET_LAYOUT_SLOTS */
  uint64_t layout_id;  /* the id of the set whose begin frame declared the layout: never 0 */
  uint32_t meta_bytes; /* 0..TSHARE_SET_META_MAX */
} tshare_set_again_frame;

/* From the receiver of sets to their sender (minor 6, both ends with
 * TSHARE_CAP_SET_AGAIN): slot layout_slot does not (or no longer) hold
 * layout layout_id; the set's set_id is layout_id. The sender that still
 * records that layout there forgets it and sends its builder whole next. */
typedef struct tshare_set_dropped_frame {
  uint8_t layout_slot; /* 1..TSHARE_SET_LAYOUT_SLOTS */
  uint64_t layout_id;  /* never 0; the frame's set_id */
} tshare_set_dropped_frame;

/* One memory of the set, described as a share frame describes its memory:
 * TSHARE_MEM_HOST_MEMFD (its fd attached), TSHARE_MEM_CUDA_IPC (its handle),
 * TSHARE_MEM_CUDA_FD (its first chunk's fd attached; with
 * TSHARE_SHARE_FLAG_CHUNKS the others came in chunk frames just before) or
 * TSHARE_MEM_CUDA_HELD (a run the receiver said it keeps mapped), or, to a
 * peer with TSHARE_CAP_SET_HOST_KEPT, TSHARE_MEM_HOST_KEPT (a memfd the
 * receiver said it keeps mapped: no fd). share_flags travel for the CUDA
 * kinds; a host memory's frame is that of 1.3 with share_flags appended
 * only when they are not 0 (minor 5: TSHARE_SHARE_FLAG_RETIRE_NOTICE on a
 * TSHARE_MEM_HOST_MEMFD, to a peer with TSHARE_CAP_SET_HOST_KEPT). Over UCX
 * (minor 6, to a peer with TSHARE_CAP_UCX_SETS) a host memory is
 * TSHARE_MEM_UCX_REMOTE: no fd, no handle, no share_flags; alloc_id names the
 * region of the last rkey frame for it, which may come just before the MEM
 * frame, inside the set. The receiver reads the whole alloc_size (which must
 * lie inside the region) and releases the set back once every memory was
 * read. */
typedef struct tshare_set_mem_frame {
  uint32_t index;    /* 0..mem_count-1, in order */
  uint64_t alloc_id; /* identity of the allocation in the sender's process */
  uint8_t mem_kind;  /* tshare_mem_kind */
  uint8_t device_type;
  uint8_t handle_len;
  uint8_t handle[TSHARE_HANDLE_MAX];
  uint8_t device_uuid[16];
  uint64_t alloc_size;
  uint32_t share_flags; /* CUDA kinds: TSHARE_SHARE_FLAG_RETIRE_NOTICE, TSHARE_SHARE_FLAG_CHUNKS; a host memfd:
                           TSHARE_SHARE_FLAG_RETIRE_NOTICE or 0 */
} tshare_set_mem_frame;

/* The END frame: with TSHARE_FRAME_FLAG_HAS_EVENT, the event slot (announced
 * by an event frame) recorded once on the producer's stream after all CUDA
 * members: the receiver orders its work after it. */
typedef struct tshare_set_end_frame {
  uint32_t event_slot; /* < TSHARE_EVENT_SLOTS_MAX */
  uint32_t event_generation;
} tshare_set_end_frame;

typedef struct tshare_set_member_frame {
  uint32_t index;     /* 0..count-1, in order */
  uint32_t mem_index; /* < mem_count */
  uint16_t name_len;  /* 1..TSHARE_SET_NAME_MAX */
  char name[TSHARE_SET_NAME_MAX + 1]; /* NUL-terminated */
  tshare_tensor_desc tensor; /* byte_offset is relative to the memory's start */
} tshare_set_member_frame;

typedef struct tshare_set_meta_frame {
  uint32_t offset; /* of this chunk in the metadata: the chunks come in order */
  uint16_t len;    /* 1..TSHARE_SET_META_CHUNK_MAX */
  uint8_t bytes[TSHARE_SET_META_CHUNK_MAX];
} tshare_set_meta_frame;

typedef struct tshare_set_frame {
  uint8_t op;      /* tshare_set_op */
  uint64_t set_id; /* a share id of the sender: never 0 */
  union {
    tshare_set_begin_frame begin;
    tshare_set_mem_frame mem;
    tshare_set_member_frame member;
    tshare_set_meta_frame meta;
    tshare_set_end_frame end;
    tshare_set_again_frame again;
    tshare_set_dropped_frame dropped;
  } u;
} tshare_set_frame;

typedef struct tshare_release_frame {
  uint32_t count;
  uint64_t share_ids[TSHARE_RELEASE_MAX];
} tshare_release_frame;

typedef struct tshare_error_frame {
  int32_t code; /* a tshare_status */
  char message[TSHARE_ERROR_TEXT_MAX + 1];
} tshare_error_frame;

typedef struct tshare_bye_frame {
  uint32_t reason; /* 0: done; other values are application-defined */
} tshare_bye_frame;

typedef struct tshare_frame {
  uint8_t type;         /* tshare_frame_type */
  uint8_t flags;        /* TSHARE_FRAME_FLAG_* */
  uint8_t major, minor; /* as read from the header (encoding ignores them) */
  union {
    tshare_hello hello;
    tshare_share_frame share;
    tshare_release_frame release;
    tshare_error_frame error;
    tshare_bye_frame bye;
    tshare_event_frame event;
    tshare_retire_frame retire;
    tshare_ring_frame ring;
    tshare_chunk_frame chunk;
    tshare_set_frame set;
    tshare_rkey_frame rkey;
  } u;
} tshare_frame;

/* Limits on untrusted input. tshare_wire_limits_default() gives the documented
 * defaults; a value above the hard maximum above is clamped to it. */
typedef struct tshare_wire_limits {
  uint32_t max_payload;     /* default 4096: the largest valid frame is well under 2 KiB */
  uint32_t max_ndim;        /* default 32 (TSHARE_MAX_NDIM) */
  uint32_t max_tag;         /* default 64 (TSHARE_TAG_MAX) */
  uint32_t max_release_ids; /* default 256 (TSHARE_RELEASE_MAX) */
  uint64_t max_alloc_size;  /* default 2^48 bytes (256 TiB): more than any device or host has */
} tshare_wire_limits;

TSHARE_API tshare_wire_limits tshare_wire_limits_default(void);

/* Encode frame into buf (cap bytes); *len gets the frame's size. The frame is
 * validated with the same rules the decoder applies, so a sender never emits
 * what a peer would reject. Returns TSHARE_E_TOO_LARGE when cap is too small;
 * TSHARE_WIRE_FRAME_MAX bytes always suffice. */
#define TSHARE_WIRE_FRAME_MAX 4096
TSHARE_API int tshare_wire_encode(const tshare_frame *frame, uint8_t *buf, size_t cap, size_t *len, tshare_error *err);

typedef struct tshare_decoder tshare_decoder;

/* limits may be NULL for the defaults. Returns NULL when out of memory. */
TSHARE_API tshare_decoder *tshare_decoder_create(const tshare_wire_limits *limits);
TSHARE_API void tshare_decoder_destroy(tshare_decoder *dec); /* NULL is a no-op */

/* Copy n bytes into the decoder. TSHARE_E_TOO_LARGE if more is buffered than
 * one header plus max_payload could need. */
TSHARE_API int tshare_decoder_feed(tshare_decoder *dec, const void *bytes, size_t n);

/* Zero-copy variant for readers: get space to read into, then commit what was read. */
TSHARE_API int tshare_decoder_space(tshare_decoder *dec, uint8_t **ptr, size_t *avail);
TSHARE_API void tshare_decoder_commit(tshare_decoder *dec, size_t n);

/* Take the next complete frame. TSHARE_OK: *out holds it (its header fields
 * and the union member of its type; a release's or retire's ids past its
 * count, and the other members, are not written). TSHARE_AGAIN: feed
 * more bytes (out untouched). Negative: the stream is invalid (see
 * tshare_decoder_last_error); every later call returns the same status. */
TSHARE_API int tshare_decoder_next(tshare_decoder *dec, tshare_frame *out);

/* Bytes buffered that do not yet form a frame (nonzero at EOF = peer closed mid-frame). */
TSHARE_API size_t tshare_decoder_pending(const tshare_decoder *dec);

TSHARE_API const char *tshare_decoder_last_error(const tshare_decoder *dec); /* never NULL */

/* Validate a share frame as the decoder does (limits may be NULL). */
TSHARE_API int tshare_wire_check_share(const tshare_share_frame *share, const tshare_wire_limits *limits,
                                       tshare_error *err);

/* Validate one set frame alone, as the decoder does (limits may be NULL):
 * bounds, kinds, names; what needs the whole set (totals, duplicates, a
 * member inside its memory) is the receiver's. */
TSHARE_API int tshare_wire_check_set(const tshare_set_frame *set, uint8_t flags, const tshare_wire_limits *limits,
                                     tshare_error *err);

TSHARE_API const char *tshare_frame_type_name(int type); /* never NULL */

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_WIRE_H */
