#pragma once
// The line protocol between `dtrain run` (the launcher) and each node's `dtrain agent`.
//
// Launcher -> agent, on the agent's stdin (over ssh for remote nodes):
//   "token <hex>\n"   first line: the job's store secret (never in argv, never in the env
//                     of ssh); then
//   "stop\n"          tear the workers down gracefully (SIGTERM, grace, SIGKILL): the
//                     launcher's own stops (a failure, a lost node) and the user's SIGTERM
//   "stop SIGINT\n" / "stop SIGHUP\n" / "stop SIGQUIT\n"
//                     the same with that signal instead of SIGTERM: the user's Ctrl-C or
//                     SIGHUP to dtrain run, passed on to the workers as on one host (and as
//                     torchrun does). An agent that knows only "stop" reads the first word
//                     and sends SIGTERM; one that gets a name it does not know stops with
//                     SIGTERM too: a stop is never dropped (stopCommand, stopSignal)
//   "kill\n"          tear down now: SIGKILL at once (a second Ctrl-C)
//   "pause\n"         stop the round's workers (SIGTERM, grace, SIGKILL), or leave the
//                     rendezvous, and wait for the next word: a restart or a membership
//                     change is coming
//   "restart <restart count> <nodes> <round>\n"
//                     join exactly that round with that many nodes (the first join, with no
//                     word, is round 0); TORCHELASTIC_RESTART_COUNT is the count
//   "exit\n"          the job succeeded: end
//   "signal SIGUSR1\n" / "signal SIGUSR2\n"
//                     pass the signal on to each running worker (the user's, to dtrain run)
//   EOF               the launcher is gone: tear down within kLostControllerGraceS
//
// Agent -> launcher, one record per line on the agent's stdout: a type letter and
// tab-separated fields, each escaped (backslash, tab, newline) so that a record is always
// exactly one line whatever a worker printed:
//   O <rank> <text>   a worker's stdout line     E <rank> <text>   a worker's stderr line
//   N <node_rank> <nnodes> <world_size> <rank_offset> <master_addr> <master_port> <round>
//     <local workers>   the node started its workers of a round: ranks rank_offset ..
//     rank_offset + local workers - 1
//   D <code> <round>  the round's workers have all ended (after an exit, a pause or a stop)
//   W <node>          (--wait) connected, waiting to be let into a round
//   X <rank> <local_rank> <pid> <exit_code> <signal> <stopped 0|1> <flags: 1 hung, 2 not started> <when>
//     <message> <traceback> <stderr tail lines...>   a worker ended
//   T <json>          the trainer's outcome (rank 0's DTRAIN_RESULT_FILE), just before the round's D
//   F <kind> <message>  the agent failed before or around its workers; kind is "spec"
//                     (bad input, exit 2), "timeout" or "io"
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/launch/launcher.h"

namespace dtrain::launch::proto {

std::string escape(std::string_view s);
std::string unescape(std::string_view s);

// One record: type letter + escaped fields, '\n'-terminated.
std::string record(char type, const std::vector<std::string>& fields);

struct Record {
  char type = 0;
  std::vector<std::string> fields;  // unescaped
};
// Parses one line (without its '\n'). Returns nullopt for anything malformed: a remote
// peer's bytes are never trusted to be well-formed.
std::optional<Record> parse(std::string_view line);

// The "stop" line (without its '\n') for a teardown that sends the workers `sig`: "stop"
// for SIGTERM (every agent's word), "stop SIGINT" / "stop SIGHUP" / "stop SIGQUIT" for those.
std::string stopCommand(int sig);
// What a launcher's line asks of the workers if it is a stop: the signal (SIGTERM for a bare
// "stop", or a name other than SIGINT, SIGHUP, SIGTERM); nullopt when it is not a stop.
std::optional<int> stopSignal(std::string_view command);

std::string exitRecord(const WorkerExit& w);
// From an 'X' record; nullopt when malformed.
std::optional<WorkerExit> parseExit(const Record& r);

}  // namespace dtrain::launch::proto
