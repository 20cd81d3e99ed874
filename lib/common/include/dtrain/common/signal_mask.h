#pragma once
// Every signal blocked on the calling thread for this object's lifetime, the thread's mask
// restored after. Made around the start of a helper thread (std::thread inherits the mask
// at its creation, so there is no moment in which it could take a signal): process-directed
// signals then go only to the threads that handle them, which may keep them blocked at times
// (the end of a `dtrain run`) without a helper thread taking one meanwhile.
#include <pthread.h>
#include <signal.h>

namespace dtrain {

class AllSignalsBlocked {
 public:
  AllSignalsBlocked() {
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  ~AllSignalsBlocked() { ::pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  AllSignalsBlocked(const AllSignalsBlocked&) = delete;
  AllSignalsBlocked& operator=(const AllSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

}  // namespace dtrain
