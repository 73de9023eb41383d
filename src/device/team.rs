//! Teams: sets of ranks a device communicator addresses (`ncclTeam_t`), and the host-side
//! queries and rank translation NCCL provides for them.

use std::ffi::c_int;

use nccl_sys::ncclTeam_t;

use crate::calls::{self, Call};
use crate::comm::Comm;
use crate::error::{Error, Result, ResultCode};

/// A team: `size` ranks, `stride` world ranks apart, this rank being `rank` of them
/// (`ncclTeam_t`). The world team holds every rank; the LSA team the ranks that can load
/// and store each other's memory (NVLink, or one GPU); the rail team one rank of each LSA
/// team, at this rank's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Team {
    /// The number of ranks in the team.
    pub size: usize,
    /// This rank's index in the team.
    pub rank: usize,
    /// The distance in world ranks between consecutive members.
    pub stride: usize,
}

impl Team {
    fn from_raw(call: &'static str, raw: ncclTeam_t) -> Result<Team> {
        // NCCL returns an empty team when it cannot set up its device runtime (the error is
        // reported by the next call that needs it).
        let positive = |v: c_int| usize::try_from(v).ok().filter(|&v| v > 0);
        match (
            positive(raw.nRanks),
            usize::try_from(raw.rank),
            positive(raw.stride),
        ) {
            (Some(size), Ok(rank), Some(stride)) if rank < size => Ok(Team { size, rank, stride }),
            _ => Err(Error::Nccl {
                call,
                code: ResultCode::InternalError,
                description: format!(
                    "NCCL returned the team {{nRanks {}, rank {}, stride {}}}: its device \
                     runtime could not be set up on this communicator",
                    raw.nRanks, raw.rank, raw.stride
                ),
                last_error: None,
            }),
        }
    }

    pub(crate) fn to_raw(self) -> ncclTeam_t {
        let int = |v: usize| c_int::try_from(v).unwrap_or(c_int::MAX);
        ncclTeam_t {
            nRanks: int(self.size),
            rank: int(self.rank),
            stride: int(self.stride),
        }
    }
}

/// Which team a query asks for.
#[derive(Clone, Copy)]
enum Which {
    World,
    Lsa,
    Rail,
}

impl Comm {
    fn team(&self, which: Which) -> Result<Team> {
        let row: &'static Call = match which {
            Which::World => &calls::ncclTeamWorld,
            Which::Lsa => &calls::ncclTeamLsa,
            Which::Rail => &calls::ncclTeamRail,
        };
        let lib = self.library();
        lib.require_call(row)?;
        let raw = self.with_raw(row, |raw| {
            let api = lib.api();
            // SAFETY: a live communicator under its lock; the functions only read it (and
            // set up its device runtime once, as any device-API call does).
            unsafe {
                match which {
                    Which::World => api.ncclTeamWorld(raw),
                    Which::Lsa => api.ncclTeamLsa(raw),
                    Which::Rail => api.ncclTeamRail(raw),
                }
            }
        })?;
        Team::from_raw(row.name, raw.map_err(|missing| lib.missing(missing))?)
    }

    /// Every rank, this one at its rank (`ncclTeamWorld`, NCCL 2.28).
    pub fn world_team(&self) -> Result<Team> {
        self.team(Which::World)
    }

    /// The ranks this rank can load from and store to (`ncclTeamLsa`, NCCL 2.28): GPUs of
    /// one NVLink domain, or ranks sharing a GPU. Sets up NCCL's device runtime on first use.
    pub fn lsa_team(&self) -> Result<Team> {
        self.team(Which::Lsa)
    }

    /// One rank of each LSA team, at this rank's position in its own (`ncclTeamRail`,
    /// NCCL 2.28).
    pub fn rail_team(&self) -> Result<Team> {
        self.team(Which::Rail)
    }

    /// The world rank of rank `rank` of `team` (`ncclTeamRankToWorld`, NCCL 2.28).
    pub fn team_rank_to_world(&self, team: Team, rank: usize) -> Result<usize> {
        self.translate(&calls::ncclTeamRankToWorld, team, rank, self.size())
    }

    /// The LSA rank of rank `rank` of `team`, which must lie in this rank's LSA team
    /// (`ncclTeamRankToLsa`, NCCL 2.28).
    pub fn team_rank_to_lsa(&self, team: Team, rank: usize) -> Result<usize> {
        let lsa = self.lsa_team()?.size;
        self.translate(&calls::ncclTeamRankToLsa, team, rank, lsa)
    }

    fn translate(
        &self,
        row: &'static Call,
        team: Team,
        rank: usize,
        bound: usize,
    ) -> Result<usize> {
        if rank >= team.size {
            return Err(Error::invalid(format!(
                "{}: rank {rank} is not in a team of {} ranks",
                row.name, team.size
            )));
        }
        let lib = self.library();
        lib.require_call(row)?;
        let rank_c =
            c_int::try_from(rank).map_err(|_| Error::invalid("rank does not fit a C int"))?;
        let raw_team = team.to_raw();
        let out = self.with_raw(row, |raw| {
            // SAFETY: a live communicator under its lock; the team is passed by value and
            // only arithmetic is done with it.
            unsafe {
                if std::ptr::eq(row, &calls::ncclTeamRankToWorld) {
                    lib.api().ncclTeamRankToWorld(raw, raw_team, rank_c)
                } else {
                    lib.api().ncclTeamRankToLsa(raw, raw_team, rank_c)
                }
            }
        })?;
        let out = out.map_err(|missing| lib.missing(missing))?;
        usize::try_from(out)
            .ok()
            .filter(|&r| r < bound)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{}: rank {rank} of team {team:?} maps to {out}, outside 0..{bound} (a team \
                     of another communicator, or not reachable from this rank)",
                    row.name
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_or_inconsistent_teams_are_errors() {
        let ok = Team::from_raw(
            "ncclTeamLsa",
            ncclTeam_t {
                nRanks: 2,
                rank: 1,
                stride: 1,
            },
        );
        assert_eq!(
            ok.unwrap(),
            Team {
                size: 2,
                rank: 1,
                stride: 1
            }
        );
        for bad in [
            ncclTeam_t::default(),
            ncclTeam_t {
                nRanks: 2,
                rank: 2,
                stride: 1,
            },
            ncclTeam_t {
                nRanks: 2,
                rank: -1,
                stride: 1,
            },
            ncclTeam_t {
                nRanks: 2,
                rank: 0,
                stride: 0,
            },
        ] {
            let err = Team::from_raw("ncclTeamLsa", bad).unwrap_err();
            assert!(err.to_string().contains("device runtime"), "{err}");
        }
        let team = Team {
            size: 4,
            rank: 3,
            stride: 2,
        };
        assert_eq!(
            team.to_raw(),
            ncclTeam_t {
                nRanks: 4,
                rank: 3,
                stride: 2
            }
        );
    }
}
