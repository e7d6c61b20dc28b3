/*
 * cupy_ipcpool.hpp -- C++17 RAII over the C library (cupy_ipcpool.h): every call is the C
 * call, nothing is implemented twice.  Header-only; link the C library as for C.
 *
 *   namespace cip = cupy_ipcpool;
 *   auto sub = cip::subscription::open("/tmp/camera.sock");      // the GPU layer
 *   while (auto frame = sub.recv(1000)) {                         // std::nullopt: timeout
 *       frame->wait(stream);                                      // order `stream` after
 *       launch(frame->array(0).data, stream);                     // the producer's write
 *       frame->release(stream);                                   // or at scope exit
 *   }
 *
 *   auto pub = cip::publisher::open_raw(path, opts, payload, fds); // your slots (no GPU)
 *   if (auto slot = pub.acquire(1000)) {                           // std::nullopt: all held
 *       write_into(*slot);
 *       pub.publish(*slot, metadata);                              // its seq
 *   }                                                              // closed at scope exit
 *
 * A failing call throws cupy_ipcpool::error (its cip_status and cip_last_error()); the
 * end of a stream is an error too (CIP_ERR_END_OF_STREAM, _PUBLISHER_GONE, _EVICTED).
 * A frame that goes out of scope unreleased is released there (a GPU frame on the
 * legacy default stream); destructors never throw.  Objects are move-only; each is used
 * by one thread at a time, as its C handle is.
 */
#ifndef CUPY_IPCPOOL_HPP
#define CUPY_IPCPOOL_HPP

#include "cupy_ipcpool.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cupy_ipcpool {

/* A failed call: its status and the library's message. */
class error : public std::runtime_error {
  public:
    error(cip_status status, const std::string &message)
        : std::runtime_error(std::string(cip_status_name(status)) + ": " + message),
          status_(status)
    {
    }
    cip_status status() const noexcept { return status_; }

  private:
    cip_status status_;
};

namespace detail {
inline void
check(cip_status status)
{
    if (status != CIP_OK)
        throw error(status, cip_last_error());
}
} // namespace detail

/* What to ask of the publisher (cip_sub_options). */
struct options {
    cip_mode mode = CIP_MODE_BLOCK;
    uint32_t credit = 0;                /* 0: 1 for latest, 64 for block */
    int timeout_ms = 10000;             /* connect and handshake */
    int device = -1;                    /* GPU layer: -1, the producer's GPU */
    std::vector<uint32_t> allowed_uids; /* empty: this process's euid */
};

class subscription;

/* A frame of a protocol-layer subscription, held until release() or its end of scope. */
class raw_frame {
  public:
    raw_frame(raw_frame &&other) noexcept
        : sub_(std::exchange(other.sub_, nullptr)), frame_(other.frame_)
    {
    }
    raw_frame &operator=(raw_frame &&other) noexcept
    {
        if (this != &other) {
            drop();
            sub_ = std::exchange(other.sub_, nullptr);
            frame_ = other.frame_;
        }
        return *this;
    }
    raw_frame(const raw_frame &) = delete;
    raw_frame &operator=(const raw_frame &) = delete;
    ~raw_frame() { drop(); }

    uint64_t seq() const noexcept { return frame_.seq; }
    uint32_t slot() const noexcept { return frame_.slot; }
    /* The FRAME's payload: valid until the next receive on the subscription. */
    std::string_view payload() const noexcept
    {
        return {reinterpret_cast<const char *>(frame_.payload), frame_.payload_len};
    }
    bool held() const noexcept { return sub_ != nullptr; }
    /* Return the lease (cip_sub_release_raw); a second call does nothing. */
    void release()
    {
        if (sub_ != nullptr)
            detail::check(cip_sub_release_raw(std::exchange(sub_, nullptr), frame_.seq,
                                              frame_.slot));
    }

  private:
    friend class subscription;
    raw_frame(cip_sub *sub, const cip_raw_frame &frame) noexcept : sub_(sub), frame_(frame) {}
    void drop() noexcept
    {
        if (sub_ != nullptr)
            (void)cip_sub_release_raw(std::exchange(sub_, nullptr), frame_.seq, frame_.slot);
    }
    cip_sub *sub_;
    cip_raw_frame frame_;
};

/* A frame of a GPU subscription, held until release() or its end of scope. */
class frame {
  public:
    frame(frame &&other) noexcept : sub_(std::exchange(other.sub_, nullptr)), frame_(other.frame_)
    {
    }
    frame &operator=(frame &&other) noexcept
    {
        if (this != &other) {
            drop();
            sub_ = std::exchange(other.sub_, nullptr);
            frame_ = other.frame_;
        }
        return *this;
    }
    frame(const frame &) = delete;
    frame &operator=(const frame &) = delete;
    ~frame() { drop(); }

    uint64_t seq() const noexcept { return frame_.seq; }
    uint32_t slot() const noexcept { return frame_.slot; }
    uint32_t num_arrays() const noexcept { return frame_.num_arrays; }
    /* Array i (device pointer, dtype, shape, strides): valid while the frame is held. */
    const cip_array &array(uint32_t i) const
    {
        if (i >= frame_.num_arrays)
            throw std::out_of_range("cupy_ipcpool::frame::array: no array " + std::to_string(i));
        return frame_.arrays[i];
    }
    std::string_view metadata() const noexcept
    {
        return {reinterpret_cast<const char *>(frame_.metadata), frame_.metadata_len};
    }
    bool held() const noexcept { return sub_ != nullptr; }
    /* Make `stream` wait on the GPU for the producer's write (cip_frame_wait). */
    void wait(void *stream) const
    {
        if (sub_ == nullptr)
            throw std::logic_error("cupy_ipcpool::frame::wait: the frame was released");
        detail::check(cip_frame_wait(sub_, &frame_, stream));
    }
    /* Return the lease after the work queued on `stream` (cip_sub_release); a second call
     * does nothing.  On CIP_ERR_CUDA the frame is still held. */
    void release(void *stream)
    {
        if (sub_ == nullptr)
            return;
        cip_status status = cip_sub_release(sub_, &frame_, stream);
        if (status != CIP_ERR_CUDA)
            sub_ = nullptr;
        detail::check(status);
    }

  private:
    friend class subscription;
    frame(cip_sub *sub, const cip_frame &f) noexcept : sub_(sub), frame_(f) {}
    void drop() noexcept
    {
        if (sub_ != nullptr)
            (void)cip_sub_release(std::exchange(sub_, nullptr), &frame_, nullptr);
    }
    cip_sub *sub_;
    cip_frame frame_;
};

/* A subscription to a cupy_ipcpool Publisher: cip_sub_open / cip_sub_open_raw, freed at
 * its end of scope (cip_sub_free: BYE, the flag operations done first).  Frames must not
 * outlive it. */
class subscription {
  public:
    /* The GPU layer (cip_sub_open): the pool mapped, frames as device arrays. */
    static subscription open(const std::string &path, const options &o = {})
    {
        return make(path, o, cip_sub_open);
    }
    /* The protocol layer only (cip_sub_open_raw): payloads and fds are yours. */
    static subscription open_raw(const std::string &path, const options &o = {})
    {
        return make(path, o, cip_sub_open_raw);
    }

    subscription(subscription &&other) noexcept : sub_(std::exchange(other.sub_, nullptr)) {}
    subscription &operator=(subscription &&other) noexcept
    {
        if (this != &other) {
            (void)cip_sub_free(sub_);
            sub_ = std::exchange(other.sub_, nullptr);
        }
        return *this;
    }
    subscription(const subscription &) = delete;
    subscription &operator=(const subscription &) = delete;
    ~subscription() { (void)cip_sub_free(sub_); }

    cip_sub_info info() const
    {
        cip_sub_info out{};
        detail::check(cip_sub_get_info(sub_, &out));
        return out;
    }
    /* The socket: readable when a frame (or the end) is waiting. */
    int fileno() const noexcept { return cip_sub_fileno(sub_); }

    /* The next frame within timeout_ms (-1: no limit); std::nullopt when none came. */
    std::optional<frame> recv(int timeout_ms = -1)
    {
        cip_frame f{};
        if (!next(cip_sub_recv(sub_, timeout_ms, &f)))
            return std::nullopt;
        return frame(sub_, f);
    }
    std::optional<raw_frame> recv_raw(int timeout_ms = -1)
    {
        cip_raw_frame f{};
        if (!next(cip_sub_recv_raw(sub_, timeout_ms, &f)))
            return std::nullopt;
        return raw_frame(sub_, f);
    }

    /* Raw sessions: the WELCOME's payload, and its fds (yours to close; taken once). */
    std::string_view welcome_payload() const
    {
        const uint8_t *p = nullptr;
        size_t n = 0;
        detail::check(cip_sub_welcome_payload(sub_, &p, &n));
        return {reinterpret_cast<const char *>(p), n};
    }
    std::vector<int> take_fds()
    {
        std::vector<int> fds(256); /* a WELCOME carries at most 253 (SCM_MAX_FD) */
        size_t count = 0;
        detail::check(cip_sub_take_fds(sub_, fds.data(), fds.size(), &count));
        fds.resize(count < fds.size() ? count : fds.size());
        return fds;
    }

    /* After the producer's death: the frames it never finished writing. */
    std::vector<uint64_t> incomplete_frames()
    {
        size_t count = 0;
        detail::check(cip_sub_incomplete_frames(sub_, nullptr, 0, &count));
        std::vector<uint64_t> seqs(count);
        detail::check(cip_sub_incomplete_frames(sub_, seqs.data(), seqs.size(), &count));
        seqs.resize(count < seqs.size() ? count : seqs.size());
        return seqs;
    }

    /* The C handle, for calls this header does not wrap. */
    cip_sub *get() const noexcept { return sub_; }

  private:
    explicit subscription(cip_sub *sub) noexcept : sub_(sub) {}
    static subscription make(const std::string &path, const options &o,
                             cip_status (*open)(const char *, const cip_sub_options *, cip_sub **))
    {
        cip_sub_options c;
        cip_sub_options_init(&c);
        c.mode = o.mode;
        c.credit = o.credit;
        c.timeout_ms = o.timeout_ms;
        c.device = o.device;
        c.allowed_uids = o.allowed_uids.empty() ? nullptr : o.allowed_uids.data();
        c.n_allowed_uids = o.allowed_uids.size();
        cip_sub *sub = nullptr;
        detail::check(open(path.c_str(), &c, &sub));
        return subscription(sub);
    }
    /* true: a frame; false: none within the timeout; else throws how the stream ended */
    static bool next(cip_status status)
    {
        if (status == CIP_ERR_TIMEOUT)
            return false;
        detail::check(status);
        return true;
    }
    cip_sub *sub_;
};

/* A pool attached from PoolDescriptor.to_bytes() (cip_pool_attach), closed at its end of
 * scope (cip_pool_close: no unmap under work queued in this process). */
class pool {
  public:
    static pool attach(std::string_view descriptor, int device = -1,
                       cip_transport transport = CIP_TRANSPORT_AUTO)
    {
        cip_pool *p = nullptr;
        detail::check(cip_pool_attach(descriptor.data(), descriptor.size(), device, transport, &p));
        return pool(p);
    }
    pool(pool &&other) noexcept : pool_(std::exchange(other.pool_, nullptr)) {}
    pool &operator=(pool &&other) noexcept
    {
        if (this != &other) {
            (void)cip_pool_close(pool_);
            pool_ = std::exchange(other.pool_, nullptr);
        }
        return *this;
    }
    pool(const pool &) = delete;
    pool &operator=(const pool &) = delete;
    ~pool() { (void)cip_pool_close(pool_); }

    uint32_t num_slots() const noexcept { return cip_pool_num_slots(pool_); }
    uint64_t slot_nbytes() const noexcept { return cip_pool_slot_nbytes(pool_); }
    int device() const noexcept { return cip_pool_device(pool_); }
    uint64_t slot_ptr(uint32_t slot) const
    {
        uint64_t ptr = 0;
        detail::check(cip_pool_slot_ptr(pool_, slot, &ptr));
        return ptr;
    }
    /* One packed ArrayHandle, checked against its slot. */
    cip_array array(std::string_view handle) const
    {
        cip_array out{};
        detail::check(cip_array_from_handle(pool_, handle.data(), handle.size(), &out));
        return out;
    }
    cip_pool *get() const noexcept { return pool_; }

  private:
    explicit pool(cip_pool *p) noexcept : pool_(p) {}
    cip_pool *pool_;
};

/* What a raw publisher serves (cip_pub_options; the callbacks stay the C handle's). */
struct publisher_options {
    uint32_t num_slots = 0;             /* the ring: 1..CIP_WIRE_MAX_SLOTS */
    uint32_t max_subscribers = 64;
    uint32_t max_credit = 0;            /* 0: num_slots - 2, at least 1 */
    double lease_timeout_s = 0.0;       /* 0: no limit */
    double send_timeout_s = 5.0;
    double handshake_timeout_s = 5.0;
    uint32_t max_pending_per_uid = 8;
    std::vector<uint32_t> allowed_uids; /* empty: this process's euid */
};

/* A raw publisher (cip_pub_open_raw): your slots, welcomed with `payload` and a copy of each
 * of `fds`; closed at its end of scope (cip_pub_close, no linger). */
class publisher {
  public:
    static publisher open_raw(const std::string &path, const publisher_options &o,
                              std::string_view payload, const std::vector<int> &fds)
    {
        cip_pub_options c;
        cip_pub_options_init(&c);
        c.num_slots = o.num_slots;
        c.max_subscribers = o.max_subscribers;
        c.max_credit = o.max_credit;
        c.lease_timeout_s = o.lease_timeout_s;
        c.send_timeout_s = o.send_timeout_s;
        c.handshake_timeout_s = o.handshake_timeout_s;
        c.max_pending_per_uid = o.max_pending_per_uid;
        c.allowed_uids = o.allowed_uids.empty() ? nullptr : o.allowed_uids.data();
        c.n_allowed_uids = o.allowed_uids.size();
        cip_pub *pub = nullptr;
        detail::check(cip_pub_open_raw(path.c_str(), &c, payload.data(), payload.size(),
                                       fds.data(), fds.size(), &pub));
        return publisher(pub);
    }
    publisher(publisher &&other) noexcept : pub_(std::exchange(other.pub_, nullptr)) {}
    publisher &operator=(publisher &&other) noexcept
    {
        if (this != &other) {
            (void)cip_pub_close(pub_, 0);
            pub_ = std::exchange(other.pub_, nullptr);
        }
        return *this;
    }
    publisher(const publisher &) = delete;
    publisher &operator=(const publisher &) = delete;
    ~publisher() { (void)cip_pub_close(pub_, 0); }

    /* The next slot to write within timeout_ms (-1: no limit); std::nullopt: none came. */
    std::optional<uint32_t> acquire(int timeout_ms = -1)
    {
        uint32_t slot = 0;
        cip_status status = cip_pub_acquire(pub_, timeout_ms, &slot);
        if (status == CIP_ERR_TIMEOUT)
            return std::nullopt;
        detail::check(status);
        return slot;
    }
    /* Publish the frame written in `slot`; its sequence number. */
    uint64_t publish(uint32_t slot, std::string_view payload = {})
    {
        uint64_t seq = 0;
        detail::check(cip_pub_publish_raw(pub_, slot, payload.data(), payload.size(), &seq));
        return seq;
    }
    /* Leases ended since the last poll, waiting up to timeout_ms for one. */
    uint64_t poll(int timeout_ms = 0)
    {
        uint64_t returned = 0;
        detail::check(cip_pub_poll(pub_, timeout_ms, &returned));
        return returned;
    }
    uint32_t subscribers() const noexcept { return cip_pub_subscribers(pub_); }
    /* BYE to every subscriber, waiting up to linger_ms for them to hang up; true when all
     * had.  The handle is gone afterwards. */
    bool close(int linger_ms = 0)
    {
        cip_status status = cip_pub_close(std::exchange(pub_, nullptr), linger_ms);
        if (status == CIP_ERR_TIMEOUT)
            return false;
        detail::check(status);
        return true;
    }
    cip_pub *get() const noexcept { return pub_; }

  private:
    explicit publisher(cip_pub *pub) noexcept : pub_(pub) {}
    cip_pub *pub_;
};

} // namespace cupy_ipcpool

#endif /* CUPY_IPCPOOL_HPP */
