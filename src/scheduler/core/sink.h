// Where the scheduler core sends messages: a client's Generate stream or an
// engine's assignment stream (server/stream_writer.h), or a test's recorder.
#pragma once
#include <grpcpp/support/status.h>

namespace moelink::scheduler {

// The core calls send/close while holding its lock, so an implementation
// must neither block nor call back into the core.
template <class Msg>
class Sink {
 public:
  virtual ~Sink() = default;
  // Queues one message (taken by value: prompts are large, callers move);
  // false once the stream is closed (the message is dropped).
  virtual bool send(Msg msg) = 0;
  // Ends the stream with `status` after the queued messages.
  virtual void close(const grpc::Status& status) = 0;
};

}  // namespace moelink::scheduler
